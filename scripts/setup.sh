#!/usr/bin/env bash
# Installs what the workbook needs to build and test on Debian/Ubuntu, if it is missing.
# With everything present it only checks: no apt, no output (the Makefile runs it before the
# first build). Otherwise it prints one line per step; apt's own output goes to $SETUP_LOG
# (build/setup.log), whose tail is shown only when apt fails.
# As root it runs apt-get; otherwise it prints the exact command to run and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
log=${SETUP_LOG:-build/setup.log}

need() { # need <package> <test command...>
    local pkg=$1; shift
    "$@" >/dev/null 2>&1 || missing+=("$pkg")
}
has_header() { echo "#include <$1>" | ${CC:-gcc} -E -x c - "${@:2}"; }

find_missing() { # sets missing=(packages whose check fails)
    missing=()
    need build-essential  command -v gcc make
    need libcjson-dev     has_header cjson/cJSON.h
    need libdnnl-dev      has_header oneapi/dnnl/dnnl.h
    need libopenmpi-dev   has_header mpi.h -I/usr/lib/x86_64-linux-gnu/openmpi/include
    need openmpi-bin      command -v mpirun
    need python3          command -v python3
    # the tests compare with an independent PyTorch GPT-2 (Debian's python3 and torch)
    need python3-torch    /usr/bin/python3 -c "import torch"
    need python3-numpy    /usr/bin/python3 -c "import numpy"
    # the phi oracle (transformers from PyPI) runs in a venv over Debian's python3 and its torch
    need python3-venv     /usr/bin/python3 -c "import ensurepip, venv"
    # plots and the report page of `make demo`, `make plot` and `make report`
    need gnuplot-nox      command -v gnuplot
}

step() { # step <what> <command...>: one line for the step, the command's output to $log
    printf 'setup: %s ... ' "$1"
    if "${@:2}" >>"$log" 2>&1; then
        echo done
        return
    fi
    echo failed
    echo "setup: the last lines of $log:" >&2
    tail -n 15 "$log" | sed 's/^/    /' >&2
    exit 1
}

find_missing
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing packages. Please run:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
fi
mkdir -p "$(dirname "$log")"
: >"$log"
export DEBIAN_FRONTEND=noninteractive
step "updating the package lists (apt-get update)" apt-get update
step "installing ${missing[*]}" apt-get install -y --no-install-recommends "${missing[@]}"
# a package that installs but does not provide what the build looks for would fail later, in
# the compiler's words: say it here
find_missing
if [ ${#missing[@]} -ne 0 ]; then
    echo "setup: still missing after apt-get install: ${missing[*]} (apt's output: $log)" >&2
    exit 1
fi

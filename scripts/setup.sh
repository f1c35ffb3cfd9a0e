#!/usr/bin/env bash
# Installs what the workbook needs to build and test on Debian/Ubuntu, if it is missing.
# As root it runs apt-get; otherwise it prints the exact command to run and stops.
set -euo pipefail

missing=()
need() { # need <package> <test command...>
    local pkg=$1; shift
    "$@" >/dev/null 2>&1 || missing+=("$pkg")
}
has_header() { echo "#include <$1>" | ${CC:-gcc} -E -x c - "${@:2}"; }

need build-essential  command -v gcc make
need libcjson-dev     has_header cjson/cJSON.h
need libdnnl-dev      has_header oneapi/dnnl/dnnl.h
need libopenmpi-dev   has_header mpi.h -I/usr/lib/x86_64-linux-gnu/openmpi/include
need openmpi-bin      command -v mpirun
need python3          command -v python3
# the tests compare with an independent PyTorch GPT-2 (Debian's python3 and torch)
need python3-torch    /usr/bin/python3 -c "import torch"
need python3-numpy    /usr/bin/python3 -c "import numpy"

if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
    echo "setup: missing packages. Please run:" >&2
    echo "  sudo apt-get update && sudo $cmd" >&2
    exit 1
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
$cmd -qq

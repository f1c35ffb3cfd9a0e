#!/usr/bin/env bash
# scripts/setup.sh and the Makefile's setup stamp, with a stand-in apt-get first on PATH (it
# records its calls and prints apt-like noise; nothing is installed):
#  - with every package present: no apt call, no output, exit 0 (also through `make setup`);
#  - with packages missing: one line per step, apt's noise only in the log; when apt fails, the
#    log's tail and exit 1; when apt "succeeds" but a package is still missing, that is said;
#  - renewing the stamp does not make the objects stale.
source "$(dirname "$0")/lib.sh"
bin=$tmp/bin calls=$tmp/apt-calls
mkdir -p "$bin"
# apt-get: records its arguments; `install` "provides" the headers (see cc) unless told to fail
cat >"$bin/apt-get" <<EOF
#!/bin/sh
echo "\$*" >>"$calls"
echo "Reading package lists... Done (apt noise)"
[ "\${1:-}" = install ] || exit 0
[ -n "\${FAKE_APT_FAIL:-}" ] && { echo "E: Unable to locate package libdnnl-dev"; exit 100; }
[ -n "\${FAKE_APT_NOOP:-}" ] || touch "$tmp/installed"
EOF
# cc: the preprocessor finds no header until the stand-in apt-get has "installed" them
cat >"$bin/cc" <<EOF
#!/bin/sh
[ -e "$tmp/installed" ] && exec gcc "\$@"
exit 1
EOF
printf '#!/bin/sh\necho 0\n' >"$bin/id"  # the install path is the root one
chmod +x "$bin"/*
setup() { # setup <name> [env...]: runs the script with the stand-ins, output in $tmp/<name>.out
    local name=$1; shift
    env PATH="$bin:$PATH" SETUP_LOG="$tmp/$name.log" "$@" bash scripts/setup.sh >"$tmp/$name.out" 2>&1
}

# ---- everything present ----
setup present
rc=$?; check '[ $rc -eq 0 ] && [ ! -s "$tmp/present.out" ] && [ ! -e "$calls" ]' \
    "with every package present: exit $rc, apt calls: $(cat "$calls" 2>/dev/null), output: $(cat "$tmp/present.out")"
env PATH="$bin:$PATH" make --no-print-directory BACKEND=cpu setup SETUP_STAMP="$tmp/stamp" >"$tmp/make.out" 2>&1
rc=$?; check '[ $rc -eq 0 ] && [ -e "$tmp/stamp" ] && [ ! -s "$tmp/make.out" ] && [ ! -e "$calls" ]' \
    "make setup with every package present: exit $rc, apt calls: $(cat "$calls" 2>/dev/null), output: $(cat "$tmp/make.out")"

# ---- three packages missing (their headers), apt succeeds ----
setup install CC="$bin/cc"
rc=$?
expected="setup: updating the package lists (apt-get update) ... done
setup: installing libcjson-dev libdnnl-dev libopenmpi-dev ... done"
check '[ $rc -eq 0 ] && [ "$(cat "$tmp/install.out")" = "$expected" ]' "installing: exit $rc, output: $(cat "$tmp/install.out")"
check 'grep -q "apt noise" "$tmp/install.log" && grep -q "^install -y --no-install-recommends libcjson-dev libdnnl-dev libopenmpi-dev$" "$calls"' \
    "apt's output is not in the log, or the install call differs: $(cat "$calls")"

# ---- apt fails: its last lines, exit 1 ----
rm -f "$tmp/installed"
setup fail CC="$bin/cc" FAKE_APT_FAIL=1
rc=$?
check '[ $rc -eq 1 ] && grep -q "^setup: installing libcjson-dev libdnnl-dev libopenmpi-dev ... failed$" "$tmp/fail.out" && grep -q "E: Unable to locate package libdnnl-dev" "$tmp/fail.out"' \
    "apt failing: exit $rc, output: $(cat "$tmp/fail.out")"

# ---- apt succeeds but the headers are still not there ----
setup noop CC="$bin/cc" FAKE_APT_NOOP=1
rc=$?
check '[ $rc -eq 1 ] && grep -q "still missing after apt-get install: libcjson-dev libdnnl-dev libopenmpi-dev" "$tmp/noop.out"' \
    "packages still missing after apt: exit $rc, output: $(cat "$tmp/noop.out")"

# ---- a renewed stamp leaves the objects up to date (they need it first, not newer) ----
obj=build/cpu/common/base/log.o
if [ -e "$obj" ]; then
    touch "$tmp/stamp"
    make -q BACKEND=cpu SETUP_STAMP="$tmp/stamp" "$obj"
    rc=$?; check '[ $rc -eq 0 ]' "a renewed setup stamp makes $obj out of date (make -q exit $rc)"
fi
finish test_setup

#!/usr/bin/env bash
# The FP8 formats of common/numbers.h (e4m3, e5m2: the casts, plain and saturating, the decode, the
# tensorwise scale and MX's E8M0 block scale) against ml_dtypes, bit for bit on 2 x 10^6 values a
# format (tests/oracle_fp8.py says which). ml_dtypes comes from PyPI into a venv of its own over
# Debian's python3 and numpy, made once: build/fp8-venv.
source "$(dirname "$0")/lib.sh"
BIN=build/tests/fp8_codes
VENV=build/fp8-venv
if ! "$VENV/bin/python" -c 'import ml_dtypes' 2>/dev/null; then
    rm -rf "$VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV" &&
        "$VENV/bin/pip" install -q ml_dtypes==0.5.4 >"$tmp/pip.log" 2>&1
fi
check '"$VENV/bin/python" -c "import ml_dtypes; assert ml_dtypes.__version__ == \"0.5.4\""' \
    "ml_dtypes 0.5.4 does not import in $VENV (pip: $(tail -2 "$tmp/pip.log" 2>/dev/null))"
check '[ -x "$BIN" ]' "$BIN is not built (make test builds it)"

"$VENV/bin/python" tests/oracle_fp8.py "$BIN" "$tmp" >"$tmp/oracle.txt" 2>"$tmp/oracle.err"
cat "$tmp/oracle.txt"
passed=$((passed + $(grep -c '^ok: ' "$tmp/oracle.txt")))
failed=$((failed + $(grep -c '^FAIL: ' "$tmp/oracle.txt")))
check "[ \$(grep -c '^ok: \|^FAIL: ' '$tmp/oracle.txt') -eq 10 ]" "tests/oracle_fp8.py did not run to the end: $(tail -3 "$tmp/oracle.err")"
finish test_fp8

#!/usr/bin/env bash
# The READMEs and docs name only what exists: every name in backticks in README.md, NN_*/README.md
# and docs/*.md, and every command of their ```sh blocks, is checked against the tree by
# tests/doc_names.py (its header says how each kind of name is read): a path exists, an identifier
# is a word of the sources, a config key is one that build/stage-1 --help lists, `make X` names a
# target of the Makefile, a command's program exists. One check per name, so a renamed function
# or a moved file fails here instead of drifting silently. `bash tests/test_docs.sh -v` prints every
# name with what it was taken for, the skipped ones too.
source "$(dirname "$0")/lib.sh"
verbose=${1:-}

# The exceptions: "token | why it names nothing in the tree". Each must still be named by a
# document, or the check fails.
cat >"$tmp/allow" <<'EOF'
--allow-run-as-root | Open MPI's mpirun option (running as root in a container); the tree sets the environment form
docker0 | a network interface name, Docker's bridge: an example of a wrong one
all_reduce_perf | nccl-tests' program, not the workbook's
gds | PMIx's gds component named by its error messages
tail -f slurm/logs/stage-3-1234.out | an example job's log: job 1234's
EOF

# the config keys, from the key table itself (common/config/config.c) through --help
if [ ! -x build/stage-1 ]; then
    make --no-print-directory -j2 BACKEND=cpu build/stage-1 >"$tmp/make.log" 2>&1
fi
build/stage-1 --help 2>/dev/null | sed -n 's/^  --\([a-z_0-9]*\) .*/\1/p' >"$tmp/keys"
check '[ "$(wc -l <"$tmp/keys")" -ge 40 ]' "build/stage-1 --help listed $(wc -l <"$tmp/keys") keys (build it: make BACKEND=cpu build/stage-1)"
# the Makefile's targets, as make itself reads them (both backends: build/cuda/... are named too)
for backend in cpu cuda; do
    make -pn BACKEND=$backend 2>/dev/null | sed -n 's/^\([^#%:= \t][^:= \t]*\):\( \|$\).*/\1/p'
done | sort -u >"$tmp/targets"
check 'grep -qx stage-1 "$tmp/targets" && grep -qx build/plan "$tmp/targets"' "make -pn lists no stage-1 or build/plan target"

docs=(README.md [0-9][0-9]_*/README.md docs/*.md)
python3 tests/doc_names.py "$tmp/keys" "$tmp/targets" "$tmp/allow" "${docs[@]}" >"$tmp/names"
rc=$?
check '[ $rc -eq 0 ] && [ -s "$tmp/names" ]' "tests/doc_names.py failed (exit $rc)"
while IFS=$'\t' read -r state where token what; do
    [ "$verbose" = -v ] && printf '%-4s %-34s %-40s %s\n' "$state" "$where" "$token" "$what"
    [ "$state" = skip ] && continue
    check '[ "$state" = ok ]' "$where: \`$token\` ($what)"
done <"$tmp/names"
finish test_docs

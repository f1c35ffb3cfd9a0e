#!/usr/bin/env bash
# Prints the first Python that imports torch: $TORCH_PYTHON, python3, /usr/bin/python3 (Debian's
# python3-torch); exits 1 printing nothing where none does. For scripts/bench_bound.sh and
# tests/test_bench_torch.sh.
for py in ${TORCH_PYTHON:-} python3 /usr/bin/python3; do
    if "$py" -c "import torch" 2>/dev/null; then echo "$py"; exit 0; fi
done
exit 1

#!/usr/bin/env bash
# Plots (scripts/plot.sh, gnuplot) and the report page (tools/report.py) in a real browser:
#  - plots: PNG and SVG, non-empty, one curve per run given; a run directory without metrics is
#    one error naming it;
#  - the report of a stage-01 run and a traced stage-03 run renders in headless Chromium
#    (Debian's, installed by tests/setup_browser.sh): a screenshot is taken, the page logs no
#    console error, every image loads, and the numbers in its tables equal the runs'
#    metrics.jsonl and stats.json; a page with a broken image is caught (the check can fail).
source "$(dirname "$0")/lib.sh"
source tests/mpi_env.sh
bash tests/setup_browser.sh || { echo "test_report: 0 passed, 1 failed"; exit 1; }
args=(--config configs/tiny.json --stop_iteration=3 --eval_batches=1 --log_interval=100 --n_layer=2 --n_embd=64)

build/stage-1 "${args[@]}" --out_dir="$tmp/single" >"$tmp/single.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "stage 1 failed: $(tail -3 "$tmp/single.log")"
run_ranks 3 ddp 2 --overlap_communication=true --bucket_size_mb=0.05 --trace=true

# ---- plots ----
bash scripts/plot.sh -o "$tmp/plots" "$tmp/single" "$tmp/ddp" >"$tmp/plot.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "plot.sh failed: $(cat "$tmp/plot.log")"
for f in loss tokens_per_sec memory; do
    for ext in png svg; do check '[ -s "$tmp/plots/$f.$ext" ]' "$f.$ext is missing or empty"; done
    curves=$(grep -c '<g id="gnuplot_plot_' "$tmp/plots/$f.svg")
    want=2; [ $f = loss ] && want=4  # training and validation for each run
    check '[ "$curves" = "$want" ]' "$f.svg has $curves curves for 2 runs, want $want"
done
mkdir -p "$tmp/empty"
expect_one_error "plot of a directory without metrics" "$tmp/empty" bash scripts/plot.sh -o "$tmp/p2" "$tmp/single" "$tmp/empty"

# ---- the report in a browser ----
python3 tools/report.py -o "$tmp/report" "$tmp/single" "$tmp/ddp" >"$tmp/report.log" 2>&1
rc=$?; check '[ $rc -eq 0 ]' "report.py failed: $(cat "$tmp/report.log")"
expect_one_error "report of a directory without metrics" "$tmp/empty" python3 tools/report.py -o "$tmp/r2" "$tmp/empty"

browse() { # browse <page dir>: <dir>.dom (the DOM after load), <dir>.log (console), <dir>.png
    local flags=(--headless=new --no-sandbox --disable-gpu --enable-logging=stderr --v=0)
    timeout 120 chromium "${flags[@]}" --dump-dom "file://$1/index.html" >"$1.dom" 2>"$1.log"
    timeout 120 chromium "${flags[@]}" --window-size=1200,2000 --screenshot="$1.png" "file://$1/index.html" \
        >/dev/null 2>>"$1.log"
}
browse "$tmp/report"
check '[ -s "$tmp/report.png" ]' "headless Chromium took no screenshot: $(tail -3 "$tmp/report.log")"
check '! grep -q "CONSOLE" "$tmp/report.log"' "the page logged to the console: $(grep CONSOLE "$tmp/report.log")"
loaded=$(sed -n 's/.*data-images-loaded="\([0-9]*\)".*/\1/p' "$tmp/report.dom")
images=$(sed -n 's/.*data-images="\([0-9]*\)".*/\1/p' "$tmp/report.dom")
# 3 plots and the traced run's timeline
check '[ "$images" = 4 ] && [ "$loaded" = "$images" ]' "images loaded: '$loaded' of '$images', want all of 4"

# the control: a missing image is reported by the same checks
cp -r "$tmp/report" "$tmp/broken" && sed -i 's/src="memory.svg"/src="missing.svg"/' "$tmp/broken/index.html"
browse "$tmp/broken"
check 'grep -q "CONSOLE.*missing.svg" "$tmp/broken.log"' "a broken image went unnoticed"

# every number the tables show, against the files it came from
out=$(python3 - "$tmp/report.dom" "$tmp/single" "$tmp/ddp" <<'PY'
import json, sys
from html.parser import HTMLParser

class Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.runs, self.key = [], None
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "section":
            self.runs.append({})
        if tag == "td" and "data-key" in a:
            self.key = a["data-key"]
    def handle_data(self, data):
        if self.key:
            self.runs[-1].setdefault(self.key, []).append(float(data))
            self.key = None

page = Cells()
page.feed(open(sys.argv[1]).read())
bad = []
for run, shown in zip(sys.argv[2:], page.runs):
    metrics = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
    stats = json.load(open(f"{run}/stats.json"))
    last = metrics[-1]
    want = {"stage": [stats["stage"]], "world_size": [stats["world_size"]], "steps": [len(metrics)],
            "tokens_per_sec": [last["tokens_per_sec"]], "mfu": [last["mfu"]], "mem_bytes": [last["mem_bytes"]],
            "loss": [last["loss"]], "memory": list(stats["memory"].values()),
            "calls": [e["calls"] for e in stats["communication"]],
            "bytes_per_step": [e["bytes"] / len(metrics) for e in stats["communication"]],
            "busbw_GBps": [e["busbw_GBps"] for e in stats["communication"]]}
    for key, values in want.items():
        if [float(v) for v in values] != shown.get(key, []):
            bad.append(f"{run}: {key} shows {shown.get(key)}, files say {values}")
if len(page.runs) != len(sys.argv) - 2:
    bad.append(f"{len(page.runs)} run sections for {len(sys.argv) - 2} runs")
print("\n".join(bad))
PY
)
check '[ -z "$out" ]' "the report's numbers differ from the files: $out"
check 'grep -q "href=\"[^\"]*ddp/trace.json\"" "$tmp/report.dom"' "no link to the stage 03 run's trace"
finish test_report

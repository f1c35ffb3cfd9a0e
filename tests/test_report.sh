#!/usr/bin/env bash
# Plots (scripts/plot.sh, gnuplot) and the report page (tools/report.py) in a real browser:
#  - plots: PNG and SVG, non-empty, one curve per run given; a run directory without metrics is
#    one error naming it;
#  - the report of a stage-01 run and a traced stage-03 run renders in headless Chromium
#    (Debian's, installed by tests/setup_browser.sh): a screenshot is taken, the page logs no
#    console error, every image loads, the loss figure has its two panels (every run overlaid,
#    and the stage-03 run's difference from stage 01), the memory bars' totals are the memory
#    reports', and every number in the summary table and the per-run tables equals what the runs'
#    metrics.jsonl and stats.json say, in the unit and to the digits shown. Both checks can fail:
#    a page with a broken image and a page with one number changed are caught.
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
    bounded 120 chromium "${flags[@]}" --dump-dom "file://$1/index.html" >"$1.dom" 2>"$1.log"
    bounded 120 chromium "${flags[@]}" --window-size=1200,2000 --screenshot="$1.png" "file://$1/index.html" \
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

# the loss figure: the overlay panel draws both runs, the difference panel the one that is not the reference
overlay=$(grep -o 'id="gnuplot_plot_[0-9]*a"' "$tmp/report/loss.svg" | sort -u | wc -l)
difference=$(grep -o 'id="gnuplot_plot_[0-9]*b"' "$tmp/report/loss.svg" | sort -u | wc -l)
check '[ "$overlay" = 2 ] && [ "$difference" = 1 ]' \
    "loss.svg: $overlay overlaid curves (want 2), $difference differences (want 1)"
# each run's bar ends at its memory report's total
for run in single ddp; do
    total=$(python3 -c "import json, sys
print(f'{sum(json.load(open(sys.argv[1]))[\"memory\"].values()) / 2**20:,.1f} MiB')" "$tmp/$run/stats.json")
    check 'grep -q ">$total<" "$tmp/report/memory.svg"' "memory.svg: no bar of $run ends at its total, $total"
done
title=$(sed -n 's:.*<title>\(.*\)</title>.*:\1:p' "$tmp/report.dom")
check '[ "$title" = "Training report: 2 runs of stages 01 and 03" ]' "the page's title is '$title'"

# every number the tables show, against the files it came from: the reference for the loss
# difference is the first stage-01 run; tokens/s and MFU are the median step after the first
table_check() { # table_check <dom>: prints each number that differs from the files
    python3 - "$1" "$tmp/single" "$tmp/ddp" <<'PY'
import json, statistics, sys
from html.parser import HTMLParser

class Cells(HTMLParser):
    """shown[run][key]: the texts of the elements with that data-key, under the element that
    names the run (a summary row, a run's section)"""
    def __init__(self):
        super().__init__()
        self.shown, self.rows, self.sections, self.run, self.key = {}, 0, 0, None, None
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-run" in a:
            self.run = a["data-run"]
            self.rows += tag == "tr"
            self.sections += tag == "section"
        if "data-key" in a:
            self.key = a["data-key"]
    def handle_data(self, data):
        if self.key:
            self.shown.setdefault(self.run, {}).setdefault(self.key, []).append(data)
            self.key = None

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

def agrees(text, want):
    """the text, read in its unit, is want rounded to the digits shown; "0" is exactly 0"""
    if text == "0":
        return want == 0
    number, _, unit = text.replace(",", "").partition(" ")
    scale = UNITS[unit] if unit else 1
    mantissa, _, exponent = number.lower().partition("e")
    half_digit = 0.5 * 10.0 ** (int(exponent or 0) - len(mantissa.partition(".")[2])) * scale
    return abs(float(number) * scale - want) <= half_digit * (1 + 1e-9)

def median_step(metrics, key):
    return statistics.median([m[key] for m in metrics][1:])

page = Cells()
page.feed(open(sys.argv[1]).read())
runs = sys.argv[2:]
data = {run: ([json.loads(line) for line in open(f"{run}/metrics.jsonl")], json.load(open(f"{run}/stats.json")))
        for run in runs}
reference = next(run for run in runs if data[run][1]["stage"] == 1)
ref_loss = {m["step"]: m["loss"] for m in data[reference][0]}
bad = []
for run in runs:
    metrics, stats = data[run]
    steps, shown = len(metrics), page.shown.get(run, {})
    want = {"stage": [stats["stage"]], "ranks": [stats["world_size"]], "steps": [steps],
            "final_loss": [metrics[-1]["loss"]],
            "tokens_per_sec": [median_step(metrics, "tokens_per_sec")],
            "mfu_percent": [100 * median_step(metrics, "mfu")],
            "peak_memory_mib": [max(m["mem_bytes"] for m in metrics) / 2**20],
            "memory": [v / 2**20 for v in stats["memory"].values()],
            "calls": [e["calls"] for e in stats["communication"]],
            "bytes_per_step": [e["bytes"] / steps for e in stats["communication"]],
            "ms_per_step": [1e3 * e["seconds"] / steps for e in stats["communication"]],
            "busbw_GBps": [e["busbw_GBps"] for e in stats["communication"]]}
    if run != reference:
        want["loss_difference"] = [max(abs(m["loss"] - ref_loss[m["step"]]) / ref_loss[m["step"]]
                                       for m in metrics if m["step"] in ref_loss)]
    for key in sorted(set(want) | set(shown)):
        texts, values = shown.get(key, []), want.get(key, [])
        if len(texts) != len(values) or not all(agrees(t, v) for t, v in zip(texts, values)):
            bad.append(f"{run}: {key} shows {texts}, files say {values}")
if page.rows != len(runs) or page.sections != len(runs):
    bad.append(f"{page.rows} summary rows and {page.sections} run sections for {len(runs)} runs")
print("\n".join(bad))
PY
}
out=$(table_check "$tmp/report.dom")
check '[ -z "$out" ]' "the report's numbers differ from the files: $out"
# the control: the first run's final loss, 2 in the last digit shown more, is caught
last=$(sed -n 's:.*data-key="final_loss">\([0-9.]*\)<.*:\1:p' "$tmp/report.dom" | head -1)
sed "0,/data-key=\"final_loss\">$last</s//data-key=\"final_loss\">$(python3 -c "print(f'{$last + 0.0002:.4f}')")</" \
    "$tmp/report.dom" >"$tmp/changed.dom"
out=$(table_check "$tmp/changed.dom")
check '[ -n "$out" ] && ! cmp -s "$tmp/report.dom" "$tmp/changed.dom"' "a changed final loss went unnoticed"
check 'grep -q "href=\"[^\"]*ddp/trace.json\"" "$tmp/report.dom"' "no link to the stage 03 run's trace"
finish test_report

"""report.py [-o DIR] RUN_DIR...: one static HTML page (DIR/index.html, default report/) about a
set of training runs, read from their metrics.jsonl, stats.json and trace.json; it opens from
disk and needs nothing but a browser. It shows the loss overlay of every run (scripts/plot.sh's
gnuplot SVGs) and per run: stage, layout, precision, tokens/s, MFU and memory of the last step,
memory per rank by category, communication by group and collective (bytes per step, bus
bandwidth), the overlap of communication with block backward compute measured from the trace,
a link to the trace and the trace drawn as a timeline (one row per rank and track). Every number is printed as the run's files hold it."""
import html
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_check  # noqa: E402


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def read_run(run):
    metrics_path, stats_path = os.path.join(run, "metrics.jsonl"), os.path.join(run, "stats.json")
    for path in (metrics_path, stats_path):
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            fail(f"{path}: missing or empty; '{run}' is not a finished training run's out_dir")
    metrics = [json.loads(line) for line in open(metrics_path)]
    return metrics, json.load(open(stats_path))


def layout_text(stats):
    lay = stats.get("layout", {})
    parts = [f"dp {lay.get('dp', 1)}"]
    if lay.get("sharded"):
        parts.append("sharded")
    if "tp_dimensions" in lay:
        parts.append("tp " + "x".join(str(d) for d in lay["tp_dimensions"]))
    if "pp" in lay:
        parts.append(f"pp {lay['pp']}")
    if "ep" in lay:
        parts.append(f"ep {lay['ep']}")
    return ", ".join(parts)


def cell(value, key=None):
    attr = f' data-key="{key}"' if key else ""
    return f"<td{attr}>{html.escape(str(value))}</td>"


COLORS = [(" forward", "#4c9be8"), (" backward", "#e8884c"), ("wait ", "#d62728"), ("optimizer", "#9467bd"),
          ("data load", "#8c564b"), ("loss", "#bcbd22"), ("checkpoint", "#17becf")]
COMM_COLOR, OTHER_COLOR = "#2ca02c", "#7f7f7f"


def color_of(event):
    if event["tid"] >= 1:
        return COMM_COLOR
    return next((c for key, c in COLORS if key in event["name"]), OTHER_COLOR)


def timeline_svg(events, width=1100, row=16, label=110):
    """The trace drawn as boxes: one row per rank and track, time left to right."""
    spans = trace_check.spans(events)
    tracks = sorted({(e["pid"], e["tid"]) for e in spans})
    t0 = min(e["ts"] for e in spans)
    t1 = max(e["ts"] + e["dur"] for e in spans)
    scale = (width - label - 10) / max(t1 - t0, 1e-9)
    y = {track: 20 + i * row for i, track in enumerate(tracks)}
    height = 20 + len(tracks) * row + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="4" y="13">timeline, {(t1 - t0) / 1e3:.1f} ms (green: collectives from launch to end)</text>']
    for (pid, tid), ty in y.items():
        name = f"rank {pid} " + ("compute" if tid == 0 else f"comm {tid}")
        out.append(f'<text x="4" y="{ty + row - 4}">{name}</text>')
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        x, w = label + (e["ts"] - t0) * scale, max(e["dur"] * scale, 0.5)
        tip = html.escape(f"{e['name']} {e['dur'] / 1e3:.3f} ms" + (f" {e['args']}" if "args" in e else ""))
        out.append(f'<rect x="{x:.2f}" y="{y[(e["pid"], e["tid"])] + 2}" width="{w:.2f}" height="{row - 3}" '
                   f'fill="{color_of(e)}" stroke="black" stroke-width="0.2"><title>{tip}</title></rect>')
    legend = [("forward", "#4c9be8"), ("backward", "#e8884c"), ("collective", COMM_COLOR), ("wait", "#d62728"),
              ("optimizer", "#9467bd"), ("data load", "#8c564b")]
    for i, (name, c) in enumerate(legend):
        lx = label + i * 110
        out.append(f'<rect x="{lx}" y="{height - 20}" width="12" height="12" fill="{c}"/>'
                   f'<text x="{lx + 16}" y="{height - 10}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def overlap_text(run, out_dir, i):
    path = os.path.join(run, "trace.json")
    if not os.path.isfile(path):
        return "no trace (run with --trace=true)", ""
    events = trace_check.load(path)
    if not trace_check.spans(events):
        return "the trace holds no steps", ""
    with open(os.path.join(out_dir, f"timeline_{i}.svg"), "w") as f:
        f.write(timeline_svg(events))
    traced_steps = max(1, sum(1 for e in events if e.get("name") == "optimizer" and e.get("pid") == 0))
    comm_us = sum(e["dur"] for e in trace_check.spans(events) if e["tid"] >= 1)
    overlap = trace_check.overlap_us(events)
    link = os.path.relpath(os.path.abspath(path), os.path.abspath(out_dir))
    share = f"{100 * overlap / comm_us:.1f}% of collective time" if comm_us > 0 else "no collectives"
    text = f"{overlap / 1e3 / traced_steps:.3f} ms per step summed over ranks ({share})"
    return text, (f'<a href="{html.escape(link)}">trace.json</a> (open in ui.perfetto.dev)<br>'
                  f'<img src="timeline_{i}.svg" alt="timeline of {html.escape(run)}" onerror="imageFailed(this)">')


def run_section(i, run, out_dir):
    metrics, stats = read_run(run)
    last = metrics[-1]
    steps = len(metrics)
    overlap, trace_link = overlap_text(run, out_dir, i)
    rows = [
        "<table class=summary>",
        "<tr><th>stage</th><th>ranks</th><th>layout</th><th>precision</th><th>steps</th>"
        "<th>tokens/s (last step)</th><th>MFU (last step)</th><th>memory in use, bytes (last step)</th>"
        "<th>loss (last step)</th></tr>",
        "<tr>" + cell(stats["stage"], "stage") + cell(stats["world_size"], "world_size") + cell(layout_text(stats))
        + cell(stats["precision"], "precision") + cell(steps, "steps") + cell(last["tokens_per_sec"], "tokens_per_sec")
        + cell(last["mfu"], "mfu") + cell(last["mem_bytes"], "mem_bytes") + cell(last["loss"], "loss") + "</tr>",
        "</table>",
        "<h3>memory on one rank, by category (bytes)</h3><table class=memory>",
    ]
    rows += [f"<tr><th>{html.escape(k)}</th>{cell(v, 'memory')}</tr>" for k, v in stats.get("memory", {}).items()]
    rows.append("</table>")
    comm = stats.get("communication", [])
    if comm:
        rows.append("<h3>communication on rank 0</h3><table class=comm><tr><th>group</th><th>collective</th>"
                    "<th>calls</th><th>bytes per step</th><th>bus bandwidth GB/s</th></tr>")
        for e in comm:
            rows.append("<tr>" + cell(e["group"]) + cell(e["kind"]) + cell(e["calls"], "calls")
                        + cell(e["bytes"] / steps, "bytes_per_step") + cell(e["busbw_GBps"], "busbw_GBps") + "</tr>")
        rows.append("</table>")
    else:
        rows.append("<p>no communication (one process)</p>")
    rows.append(f"<p>communication overlapping block backward compute: {html.escape(overlap)}</p>")
    if trace_link:
        rows.append(f"<p>timeline: {trace_link}</p>")
    title = html.escape(run)
    return f'<section class=run id="run{i}" data-run="{title}"><h2>{title}</h2>\n' + "\n".join(rows) + "</section>"


def main():
    args = sys.argv[1:]
    out_dir = "report"
    if args[:1] == ["-o"]:
        out_dir, args = args[1], args[2:]
    if not args:
        fail("usage: tools/report.py [-o DIR] RUN_DIR...")
    os.makedirs(out_dir, exist_ok=True)
    sections = [run_section(i, run, out_dir) for i, run in enumerate(args)]  # checks every run first
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run(["bash", os.path.join(here, "..", "scripts", "plot.sh"), "-o", out_dir, *args],
                   check=True, stdout=subprocess.DEVNULL)
    page = f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>workbook runs</title>
<style>
body {{ font-family: sans-serif; max-width: 70em; margin: 1em auto; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
td, th {{ border: 1px solid #bbb; padding: .2em .5em; text-align: right; }}
img {{ max-width: 100%; }}
</style>
<script>
// a plot that does not load is a console error, and the body counts the ones that did
function imageFailed(img) {{ console.error("image did not load: " + img.src); }}
window.addEventListener("load", () => {{
  document.body.dataset.imagesLoaded = [...document.images].filter(i => i.naturalWidth > 0).length;
  document.body.dataset.images = document.images.length;
}});
</script></head><body>
<h1>{len(args)} run(s)</h1>
<h2>loss of every run (lines: training, points: validation)</h2>
<img src="loss.svg" alt="loss against step" onerror="imageFailed(this)">
<img src="tokens_per_sec.svg" alt="tokens per second against step" onerror="imageFailed(this)">
<img src="memory.svg" alt="memory in use against step" onerror="imageFailed(this)">
{chr(10).join(sections)}
</body></html>
"""
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(page)
    print(f"report: {os.path.join(out_dir, 'index.html')} ({len(args)} runs)")


if __name__ == "__main__":
    main()

"""report.py [-o DIR] RUN_DIR...: one static HTML page (DIR/index.html, default report/) about a
set of training runs, read from their metrics.jsonl, stats.json, config.json and trace.json; it
opens from disk and needs nothing but a browser. From the top:
  - a summary table, one row per run: stage, layout, ranks, precision, steps, final loss, the
    largest relative difference from the reference run's loss (the first stage 01 run given,
    else the first run), tokens/s and MFU of the median step, rank 0's peak memory;
  - the loss figure (gnuplot SVG): every run's loss at the steps all runs trained, overlaid, and
    each run's relative difference from the reference on a log scale; then each whole run's
    training and validation loss;
  - memory on one rank as bars by category per run;
  - per run: the memory report, communication by group and collective (bytes and time per
    step, bus bandwidth), the overlap of communication with block backward compute measured
    from the trace, a link to the trace and the trace drawn as a timeline.
Numbers are shown in human units (MiB, GB/s, %), rounded to the digits shown."""
import html
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trace_check  # noqa: E402


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(1)


def read_run(path):
    metrics_path, stats_path = os.path.join(path, "metrics.jsonl"), os.path.join(path, "stats.json")
    for p in (metrics_path, stats_path):
        if not os.path.isfile(p) or os.path.getsize(p) == 0:
            fail(f"{p}: missing or empty; '{path}' is not a finished training run's out_dir")
    config_path = os.path.join(path, "config.json")
    return {"path": path, "metrics": [json.loads(line) for line in open(metrics_path)],
            "stats": json.load(open(stats_path)),
            "model": json.load(open(config_path)) if os.path.isfile(config_path) else None}


# ---- what a run is, in words ----

def layout_text(stats):
    lay = stats.get("layout", {})
    parts = []
    if "tp_dimensions" in lay:
        parts.append("tp " + "x".join(str(d) for d in lay["tp_dimensions"]))
    if "pp" in lay:
        parts.append(f"pp {lay['pp']}")
    if "ep" in lay:
        parts.append(f"ep {lay['ep']}")
    if "cp" in lay:
        parts.append(f"cp {lay['cp']}")
    if lay.get("dp", 1) > 1 or not parts:
        parts.append(f"dp {lay.get('dp', 1)}")
    if lay.get("sharded"):
        parts.append("sharded")
    return "one process" if stats["world_size"] == 1 else ", ".join(parts)


def precision_text(stats):
    return "fp32" if stats["precision"] == "32" else stats["precision"]


def label_runs(runs):
    """Each run's name in plots and headings: stage, layout beyond one process, precision beyond
    fp32; the run's directory is added where two runs would otherwise share a name."""
    for r in runs:
        s = r["stats"]
        parts = [f"stage {s['stage']:02d}"]
        if s["world_size"] > 1:
            parts.append(layout_text(s))
        if s["precision"] != "32":
            parts.append(precision_text(s))
        r["label"] = ", ".join(parts)
    names = [r["label"] for r in runs]
    for r in runs:
        if names.count(r["label"]) > 1:
            r["label"] += f" ({os.path.basename(os.path.normpath(r['path']))})"


def reference_of(runs):
    return next((r for r in runs if r["stats"]["stage"] == 1), runs[0])


def other_model(run, ref):
    """True where both runs wrote their model's config.json and the models differ (a mixture of
    experts against a dense GPT): their losses are not meant to agree."""
    return run["model"] is not None and ref["model"] is not None and run["model"] != ref["model"]


# ---- figures from the files ----

def losses(run):
    return {m["step"]: m["loss"] for m in run["metrics"]}


def relative_differences(run, ref):
    """|loss - reference loss| / reference loss at each step both runs trained."""
    mine, theirs = losses(run), losses(ref)
    return {s: abs(mine[s] - theirs[s]) / abs(theirs[s]) for s in sorted(mine) if s in theirs}


def median_step(run, key):
    """The median over the steps after the first (which warms up), or the only step's value."""
    values = [m[key] for m in run["metrics"]]
    return statistics.median(values[1:] if len(values) > 1 else values)


def peak_memory(run):
    return max(m["mem_bytes"] for m in run["metrics"])


# ---- numbers for people ----

def thousands(x, decimals=0):
    return f"{x:,.{decimals}f}"


def significant(x, digits=3):
    if x == 0:
        return "0"
    return f"{x:,.{max(0, digits - 1 - math.floor(math.log10(abs(x))))}f}"


def mib(nbytes, decimals=1):
    return "0" if nbytes == 0 else thousands(nbytes / 2**20, decimals)


def human_bytes(nbytes):
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    k = 0
    while nbytes >= 1024 and k < len(units) - 1:
        nbytes, k = nbytes / 1024, k + 1
    return f"{nbytes:.0f} B" if k == 0 else f"{significant(nbytes)} {units[k]}"


def relative(x):
    return "0" if x == 0 else f"{x:.1e}"


def cell(text, key=None, cls=None):
    attrs = (f' data-key="{key}"' if key else "") + (f' class="{cls}"' if cls else "")
    return f"<td{attrs}>{html.escape(str(text))}</td>"


# ---- plots (gnuplot SVG) ----

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f"]
# the unit roundoffs: runs that add the same numbers in another order differ by a few of these
ROUNDINGS = [(2.0**-24, "fp32 rounding"), (2.0**-8, "bf16 rounding")]
MEMORY_CATEGORIES = [("parameters", "#4c72b0"), ("bf16 copies", "#a6bddb"), ("gradients", "#dd8452"),
                     ("AdamW state", "#55a868"), ("gathered buffers", "#c44e52"), ("activations", "#8172b3"),
                     ("other", "#937860")]


def color(j):
    return PALETTE[j % len(PALETTE)]


def quoted(text):
    """A gnuplot string literal."""
    return "'" + text.replace("'", "''") + "'"


def write_rows(path, rows):
    with open(path, "w") as f:
        f.writelines(" ".join(str(c) for c in row) + "\n" for row in rows)
    return quoted(path)


def gnuplot(script):
    try:
        subprocess.run(["gnuplot"], input=script, text=True, check=True, stderr=subprocess.PIPE)
    except FileNotFoundError:
        fail("gnuplot not found (scripts/setup.sh installs gnuplot-nox)")
    except subprocess.CalledProcessError as e:
        fail(f"gnuplot failed: {e.stderr.strip()}")


def svg_terminal(out_dir, name, width, height):
    return (f"set terminal svg size {width},{height} dynamic enhanced font 'sans,12'\n"
            f"set output {quoted(os.path.join(out_dir, name))}\nset grid\nset datafile missing 'NaN'\n")


def overlay_panel(runs, ref, data):
    """Every run's loss over the steps all runs reached, the reference drawn wide beneath."""
    first = max(min(losses(r)) for r in runs)
    last = min(max(losses(r)) for r in runs)
    every = max(1, (last - first) // 20)  # about 20 markers per curve
    curves = []
    for j, r in enumerate(runs):
        table = write_rows(os.path.join(data, f"loss_{j}.dat"), sorted(losses(r).items()))
        if r is ref:
            curves.insert(0, f"{table} using 1:2 with lines lw 6 lc rgb '{color(j)}' "
                             f"title {quoted(r['label'] + ' (reference)')} noenhanced")
        else:
            note = " (another model)" if other_model(r, ref) else ""
            curves.append(f"{table} using 1:2 with linespoints pi {every} pt {j % 12 + 1} ps 0.9 lw 1.5 "
                          f"lc rgb '{color(j)}' title {quoted(r['label'] + note)} noenhanced")
    xrange = f"set xrange [{first}:{last}]\n" if first < last else ""
    return (f"set title 'loss at steps {first}-{last}, which every run trained' noenhanced\n{xrange}"
            "set xlabel 'step'\nset ylabel 'loss (cross-entropy)'\n"
            "set key inside top right font ',10' samplen 2 spacing 0.9 box opaque\n"
            "plot " + ", ".join(curves) + "\n")


def difference_panel(runs, ref, data):
    """Each run's relative difference from the reference per step, log scale; a step where the
    two are equal is drawn on a line of its own at the bottom, labelled 0."""
    compared = [(j, r, relative_differences(r, ref)) for j, r in enumerate(runs) if r is not ref]
    compared = [c for c in compared if c[2]]
    if not compared:
        return ""
    nonzero = [d for _, _, diffs in compared for d in diffs.values() if d > 0]
    low = math.floor(math.log10(min(nonzero))) if nonzero else -9
    high = max(math.ceil(math.log10(max(nonzero))) if nonzero else -6, low + 1)
    zero_at = 10.0 ** (low - 1)
    has_zero = any(d == 0 for _, _, diffs in compared for d in diffs.values())
    tics = ([f"'0' {zero_at:g}"] if has_zero else []) + [f"'10^{{{e}}}' 1e{e}" for e in range(low, high + 1)]
    bottom = zero_at / 2 if has_zero else 10.0 ** low
    shown = [(v, name) for v, name in ROUNDINGS if 10.0**low <= v <= 10.0**high]
    # the roundoffs as dashed lines across, named on the right-hand axis, outside the data
    lines = "".join(f"set arrow from graph 0, first {v:g} to graph 1, first {v:g} nohead dt 2 lc rgb '#555555'\n"
                    for v, _ in shown)
    if shown:
        lines += (f"set logscale y2\nset y2range [{bottom:g}:{10.0 ** high:g}]\nset y2tics "
                  f"({', '.join(f'{quoted(name)} {v:g}' for v, name in shown)}) font ',10' tc rgb '#444444'\n")
    curves = []
    for j, r, diffs in compared:
        table = write_rows(os.path.join(data, f"difference_{j}.dat"),
                           [(s, d if d > 0 else zero_at) for s, d in diffs.items()])
        every = max(1, len(diffs) // 20)
        curves.append(f"{table} using 1:2 with linespoints pi {every} pt {j % 12 + 1} ps 0.9 lw 1.5 "
                      f"lc rgb '{color(j)}' notitle")
    return (f"set title {quoted('relative difference from ' + ref['label'] + ': |loss - reference| / reference')}"
            " noenhanced\nunset xrange\nset key off\nset logscale y\n"
            f"set yrange [{bottom:g}:{10.0 ** high:g}]\nset ytics ({', '.join(tics)})\n"
            "set ylabel 'relative difference (log scale)'\n" + lines + "plot " + ", ".join(curves) + "\n")


def loss_figure(runs, ref, out_dir, data):
    differences = difference_panel(runs, ref, data)
    layout = "set multiplot layout 1,2\n" if differences else "set multiplot layout 1,1\n"
    gnuplot(svg_terminal(out_dir, "loss.svg", 1100, 440) + layout + overlay_panel(runs, ref, data)
            + differences + "unset multiplot\n")


def whole_runs_figure(runs, out_dir, data):
    """Each run's training loss (lines) and validation loss (points) over all its steps; the step
    axis is logarithmic, so a run of 20 steps shows beside one of 1000."""
    curves = []
    for j, r in enumerate(runs):
        table = write_rows(os.path.join(data, f"whole_{j}.dat"),
                           [(m["step"], m["loss"], m.get("val_loss", "NaN")) for m in r["metrics"]])
        curves.append(f"{table} using 1:2 with lines lw 1.5 lc rgb '{color(j)}' title {quoted(r['label'])} noenhanced")
        curves.append(f"{table} using 1:3 with points pt 7 ps 0.7 lc rgb '{color(j)}' notitle")
    gnuplot(svg_terminal(out_dir, "loss_whole.svg", 1100, 400)
            + "set title 'loss over each whole run (lines: training, points: validation)'\n"
            "set logscale x\nset xlabel 'step (log scale)'\nset ylabel 'loss (cross-entropy)'\n"
            "set key inside top right font ',10' samplen 2 spacing 0.9 box opaque\n"
            "plot " + ", ".join(curves) + "\n")


def memory_category(item):
    """The category of a memory report item, from the words the stages print."""
    name = item.lower()
    if "gathered" in name or "blocks" in name:
        return "gathered buffers"
    if "bf16" in name and ("copy" in name or "copies" in name):
        return "bf16 copies"
    for word, category in (("parameters", "parameters"), ("gradient", "gradients"), ("adamw", "AdamW state"),
                           ("activation", "activations")):
        if word in name:
            return category
    return "other"


def memory_by_category(run):
    totals = {name: 0 for name, _ in MEMORY_CATEGORIES}
    for item, nbytes in run["stats"].get("memory", {}).items():
        totals[memory_category(item)] += nbytes
    return totals


def memory_figure(runs, out_dir, data):
    """One horizontal bar per run (the first at the top), stacked by category, MiB on rank 0."""
    n = len(runs)
    rows = {name: [] for name, _ in MEMORY_CATEGORIES}
    labels, ytics, largest = [], [], 1e-9
    for i, r in enumerate(runs):
        y, x = n - 1 - i, 0.0
        for name, part in memory_by_category(r).items():
            if part > 0:
                rows[name].append((x + part / 2**21, y, x, x + part / 2**20, y - 0.35, y + 0.35))
                x += part / 2**20
        largest = max(largest, x)
        ytics.append(f"{quoted(r['label'])} {y}")
        labels.append(f"set label '{x:,.1f} MiB' at first {x:g}, first {y} offset 0.5,0 font ',10'\n")
    curves = [f"{write_rows(os.path.join(data, f'memory_{k}.dat'), rows[name])} using 1:2:3:4:5:6 "
              f"with boxxyerror fs solid 0.9 noborder lc rgb '{c}' title {quoted(name)}"
              for k, (name, c) in enumerate(MEMORY_CATEGORIES) if rows[name]]
    if not curves:
        curves = ["NaN notitle"]
    gnuplot(svg_terminal(out_dir, "memory.svg", 1100, 110 + 32 * n)
            + "set title 'memory on one rank (rank 0), by category'\nset xlabel 'MiB'\n"
            f"set xrange [0:{largest * 1.12:g}]\nset yrange [-0.6:{n - 0.4}]\n"
            f"set ytics ({', '.join(ytics)}) noenhanced\nset grid noytics\n"
            "set key below horizontal font ',10' samplen 1.5\n" + "".join(labels)
            + "plot " + ", ".join(curves) + "\n")


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
    text = f"{significant(overlap / 1e3 / traced_steps)} ms per step summed over ranks ({share})"
    return text, (f'<a href="{html.escape(link)}">trace.json</a> (open in ui.perfetto.dev)<br>'
                  f'<img src="timeline_{i}.svg" alt="timeline of {html.escape(run)}" onerror="imageFailed(this)">')




# ---- the page ----

def summary_table(runs, ref):
    head = ["stage", "layout", "ranks", "precision", "steps", "final loss",
            f"largest relative difference from {ref['label']}", "tokens/s", "MFU (%)",
            "peak MiB per rank", "run directory"]
    text_columns = {"layout", "precision", "run directory"}
    rows = ["<table class=summary><tr>" + "".join(f"<th{' class=text' if h in text_columns else ''}>"
                                                  f"{html.escape(h)}</th>" for h in head) + "</tr>"]
    for r in runs:
        s = r["stats"]
        if r is ref:
            difference = "<td class=text>reference</td>"
        else:
            diffs = relative_differences(r, ref)
            note = " <small>(another model)</small>" if other_model(r, ref) else ""
            difference = (f"<td><span data-key=loss_difference>{relative(max(diffs.values()))}</span>{note}</td>"
                          if diffs else "<td class=text>no step in common</td>")
        rows.append(f'<tr data-run="{html.escape(r["path"])}">' + cell(f"{s['stage']:02d}", "stage")
                    + cell(layout_text(s), cls="text") + cell(s["world_size"], "ranks")
                    + cell(precision_text(s), cls="text") + cell(len(r["metrics"]), "steps")
                    + cell(f"{r['metrics'][-1]['loss']:.4f}", "final_loss") + difference
                    + cell(thousands(median_step(r, "tokens_per_sec")), "tokens_per_sec")
                    + cell(f"{100 * median_step(r, 'mfu'):.1f}", "mfu_percent")
                    + cell(mib(peak_memory(r)), "peak_memory_mib")
                    + f'<td class=text><a href="#run{runs.index(r)}">{html.escape(r["path"])}</a></td></tr>')
    rows.append("</table>")
    return "\n".join(rows)


def memory_table(run):
    rows = ["<table class=memory><caption>memory report, rank 0 (MiB)</caption>"]
    rows += [f"<tr><th>{html.escape(k)}</th>{cell(mib(v, 2), 'memory')}</tr>"
             for k, v in run["stats"].get("memory", {}).items()]
    return "\n".join(rows + ["</table>"])


def communication_table(run):
    comm, steps = run["stats"].get("communication", []), len(run["metrics"])
    if not comm:
        return "<p>no communication (one process)</p>"
    rows = ["<table class=comm><caption>communication on rank 0: the run's totals per training step</caption>"
            "<tr><th class=text>group</th>"
            "<th class=text>collective</th><th>calls</th><th>bytes per step</th><th>ms per step</th>"
            "<th>bus bandwidth (GB/s)</th></tr>"]
    for e in comm:
        rows.append("<tr>" + cell(e["group"], cls="text") + cell(e["kind"], cls="text") + cell(e["calls"], "calls")
                    + cell(human_bytes(e["bytes"] / steps), "bytes_per_step")
                    + cell(significant(1e3 * e["seconds"] / steps), "ms_per_step")
                    + cell(significant(e["busbw_GBps"]), "busbw_GBps") + "</tr>")
    return "\n".join(rows + ["</table>"])


def run_section(i, run, out_dir):
    overlap, trace_link = overlap_text(run["path"], out_dir, i)
    parts = [f"<div class=tables>{memory_table(run)}\n{communication_table(run)}</div>",
             f"<p>communication overlapping block backward compute: {html.escape(overlap)}</p>"]
    if trace_link:
        parts.append(f"<p>timeline: {trace_link}</p>")
    path = html.escape(run["path"])
    return (f'<section class=run id="run{i}" data-run="{path}"><h2>{html.escape(run["label"])} '
            f"<small>{path}</small></h2>\n" + "\n".join(parts) + "</section>")


def stage_list(runs):
    stages = sorted({r["stats"]["stage"] for r in runs})
    names = [f"{s:02d}" for s in stages]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def page(runs, ref, sections):
    plural = "s" if len(runs) > 1 else ""
    title = f"Training report: {len(runs)} run{plural} of stage{plural} {stage_list(runs)}"
    return f"""<!doctype html>
<html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; max-width: 1120px; margin: 1em auto; padding: 0 1em; color: #222; }}
table {{ border-collapse: collapse; margin: .5em 0; }}
td, th {{ border: 1px solid #ccc; padding: .25em .5em; text-align: right; }}
td {{ white-space: nowrap; }}
th {{ background: #f3f3f3; font-weight: 600; }}
td.text, th.text, .memory th {{ text-align: left; }}
.summary td {{ font-variant-numeric: tabular-nums; }}
caption {{ text-align: left; font-weight: 600; padding: .2em 0; }}
.tables {{ display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; font-size: 90%; }}
h2 small {{ font-weight: normal; color: #666; font-size: 60%; }}
section.run {{ border-top: 2px solid #ddd; margin-top: 1.5em; }}
p.note {{ color: #555; font-size: 90%; max-width: 60em; }}
img {{ max-width: 100%; display: block; margin: .5em 0; }}
</style>
<script>
// a plot that does not load is a console error, and the body counts the ones that did
function imageFailed(img) {{ console.error("image did not load: " + img.src); }}
window.addEventListener("load", () => {{
  document.body.dataset.imagesLoaded = [...document.images].filter(i => i.naturalWidth > 0).length;
  document.body.dataset.images = document.images.length;
}});
</script></head><body>
<h1>{html.escape(title)}</h1>
<p>Each run's loss against the reference run ({html.escape(ref['label'])}, {html.escape(ref['path'])}), its speed
and its memory, from the run's metrics.jsonl and stats.json.</p>
{summary_table(runs, ref)}
<p class=note>Final loss: the last step's training loss. Largest relative difference: the largest
|loss &minus; reference| / reference over the steps both runs trained; 0 means equal to the last bit.
Runs that add the same numbers in another order differ by about fp32's rounding (6e-08) at first,
more as their weights drift apart over the steps; bf16 runs by about bf16's (4e-03). Tokens/s and
MFU: the median step after the first. Peak memory: rank 0's device memory in use, the largest over
the steps.</p>
<h2>Loss against the reference run</h2>
<img src="loss.svg" alt="loss at the steps every run trained, and each run's relative difference from the reference"
 onerror="imageFailed(this)">
<img src="loss_whole.svg" alt="loss over each whole run" onerror="imageFailed(this)">
<h2>Memory on one rank</h2>
<img src="memory.svg" alt="memory on rank 0 by category, one bar per run" onerror="imageFailed(this)">
{chr(10).join(sections)}
</body></html>
"""


def main():
    args = sys.argv[1:]
    out_dir = "report"
    if args[:1] == ["-o"]:
        out_dir, args = args[1], args[2:]
    if not args:
        fail("usage: tools/report.py [-o DIR] RUN_DIR...")
    runs = [read_run(path) for path in args]  # checks every run first
    label_runs(runs)
    ref = reference_of(runs)
    os.makedirs(out_dir, exist_ok=True)
    sections = [run_section(i, r, out_dir) for i, r in enumerate(runs)]
    with tempfile.TemporaryDirectory() as data:
        loss_figure(runs, ref, out_dir, data)
        whole_runs_figure(runs, out_dir, data)
        memory_figure(runs, out_dir, data)
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(page(runs, ref, sections))
    print(f"report: {os.path.join(out_dir, 'index.html')} ({len(runs)} runs)")


if __name__ == "__main__":
    main()

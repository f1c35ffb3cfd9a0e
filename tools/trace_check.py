"""trace_check.py: reads a run's merged trace.json (common/base/trace.h) and checks it is a valid
timeline, or measures it. Used by tests/test_trace.sh; prints one line per problem.

  trace_check.py valid TRACE        the checks below; exit 1 with the problems listed
  trace_check.py overlap TRACE [PART]
                                    microseconds of collectives in flight during block backward
                                    compute (or during the compute spans whose name holds PART:
                                    " ring ", stage 09's ring steps), summed over the ranks
  trace_check.py count TRACE NAME   events named NAME on each rank, as "rank:count ..."
"""
import json
import sys
from collections import defaultdict


def load(path):
    return [e for e in json.load(open(path))["traceEvents"] if e.get("ph") != "M"]


def spans(events):
    return [e for e in events if e["ph"] == "X"]


def problems_with_fields(events):
    out = []
    for e in events:
        missing = [k for k in ("ph", "ts", "pid", "tid") if k not in e]
        if missing:
            out.append(f"event {e.get('name')} lacks {missing}")
        elif e["ph"] == "X" and not e.get("dur", -1) >= 0:
            out.append(f"event {e['name']} on rank {e['pid']} has duration {e.get('dur')}")
    return out


def problems_with_nesting(events):
    """Events of one track must nest: each starts after its parent and ends before it does."""
    out, tracks = [], defaultdict(list)
    for e in spans(events):
        tracks[(e["pid"], e["tid"])].append(e)
    eps = 1e-3  # the file's microseconds carry three decimals
    for (pid, tid), evs in tracks.items():
        stack = []
        for e in sorted(evs, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + eps:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + eps:
                out.append(f"rank {pid} track {tid}: '{e['name']}' at {e['ts']} overlaps "
                           f"'{stack[-1]['name']}' without nesting in it")
            stack.append(e)
    return out


def collectives(events):
    """(group, kind) -> rank -> the collectives in the order that rank launched them."""
    table = defaultdict(lambda: defaultdict(list))
    for e in spans(events):
        if e["tid"] >= 1 and "args" in e:
            table[(e["args"]["group"], e["name"])][e["pid"]].append(e)
    for per_rank in table.values():
        for evs in per_rank.values():
            evs.sort(key=lambda e: e["ts"])
    return table


def problems_with_collectives(events):
    """Every rank of a group makes the same collectives with the same bytes, and on the merged
    clock a collective ends on every rank after the last rank started it. (Groups are matched
    by name: the runs checked have one instance of each.)"""
    out = []
    for (group, kind), per_rank in collectives(events).items():
        sizes = {pid: [e["args"]["bytes"] for e in evs] for pid, evs in per_rank.items()}
        first = next(iter(sizes.values()))
        for pid, s in sizes.items():
            if s != first:
                out.append(f"{kind} on '{group}': rank {pid} moved {s}, another rank {first}")
        if out:
            continue
        for i in range(len(first)):
            calls = [evs[i] for evs in per_rank.values()]
            last_start = max(e["ts"] for e in calls)
            for e in calls:
                if e["ts"] + e["dur"] < last_start:
                    out.append(f"{kind} #{i} on '{group}': rank {e['pid']} ends at {e['ts'] + e['dur']:.1f} "
                               f"before the last rank starts at {last_start:.1f}")
    return out


def overlap_us(events, part=None):
    total = 0.0
    by_rank = defaultdict(lambda: ([], []))
    for e in spans(events):
        if e["tid"] >= 1:
            by_rank[e["pid"]][0].append(e)
        elif part and part in e["name"] or not part and e["name"].endswith(" backward") and e["name"].startswith("block "):
            by_rank[e["pid"]][1].append(e)
    for comm, compute in by_rank.values():
        for c in comm:
            for b in compute:
                lo, hi = max(c["ts"], b["ts"]), min(c["ts"] + c["dur"], b["ts"] + b["dur"])
                total += max(0.0, hi - lo)
    return total


def main():
    what, path = sys.argv[1], sys.argv[2]
    events = load(path)
    if what == "valid":
        found = problems_with_fields(events)
        found = found or problems_with_nesting(events) + problems_with_collectives(events)
        for p in found:
            print(p)
        sys.exit(1 if found else 0)
    if what == "overlap":
        print(f"{overlap_us(events, sys.argv[3] if len(sys.argv) > 3 else None):.3f}")
    elif what == "count":
        counts = defaultdict(int)
        for e in spans(events):
            if e["name"] == sys.argv[3]:
                counts[e["pid"]] += 1
        print(" ".join(f"{pid}:{n}" for pid, n in sorted(counts.items())))


if __name__ == "__main__":
    main()

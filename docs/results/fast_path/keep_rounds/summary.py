# The Keep check of the product/lab redesign, three interleaved rounds: before = d0fabc9, after = 2584a59.
# rounds.sh ran them (worktrees of each commit, ABBA order); summary.py prints the tables in keep_step_breakdown.md.
import csv, glob, statistics, sys, re
rows = {}
# argument: the rounds' directory (default: this one; keep_rounds_quiet holds the quiet-machine rounds)
ROUNDS = sys.argv[1] if len(sys.argv) > 1 else 'docs/results/fast_path/keep_rounds'
for d in sorted(glob.glob(ROUNDS + '/*_r*.csv')):
    tree, rnd = re.search(r'/(before|after)_r(\d)\.csv', d).groups()
    for r in csv.DictReader(open(d)):
        rows[(tree, rnd, r['rate'], r['variant'])] = r
keys = list(next(iter(rows.values())).keys())
print(keys)
import math
rounds = sorted({k[1] for k in rows})
print("| rate | variant | tree | " + " | ".join(f"round {r} step (ms) / ratio" for r in rounds) + " | mean ratio | load1 |")
print("|---|---|---|" + "---:|" * (len(rounds) + 2))
summary = {}
for rate in ("1gbit", "100mbit"):
    for v in ("lioncub_1bit", "lioncub_4bit"):
        for tree in ("before", "after"):
            cells, ratios, loads = [], [], []
            for r in rounds:
                a, b = rows.get((tree, r, rate, v)), rows.get((tree, r, rate, "lion_fp32"))
                if a and b:
                    q = float(b['step_ms']) / float(a['step_ms']); ratios.append(q); loads.append(a['load1'])
                    cells.append(f"{float(a['step_ms']):.0f} / {q:.2f}x")
                else:
                    cells.append("-")
            summary[(rate, v, tree)] = ratios
            print(f"| {rate} | {v} | {tree} | " + " | ".join(cells) + f" | {statistics.fmean(ratios):.2f}x | {', '.join(loads)} |")
print()
for rate in ("1gbit", "100mbit"):
    for v in ("lioncub_1bit", "lioncub_4bit"):
        b, a = summary[(rate, v, "before")], summary[(rate, v, "after")]
        if len(a) > 1 and len(b) > 1:
            d = statistics.fmean(a) - statistics.fmean(b)
            se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
            print(f"{rate} {v}: after - before = {d:+.2f}x (Welch s.e. {se:.2f}, t {d / se if se else float('nan'):.1f})")

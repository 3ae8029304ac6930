"""after ÷ before of `evospec bench v1`: run order before1, after1, before2, after2, after3, before3 (the last pair
reversed, so a drift over time cancels). Tok/s: each run's median over its repeats; the ratio: median of the three
after runs ÷ median of the three before runs. τ and greedy identity in every run."""
import json, statistics
from pathlib import Path
names = ("before1", "after1", "before2", "after2", "after3", "before3")
runs = {n: json.loads((Path(__file__).parent / f"{n}.json").read_text())["results"] for n in names}
lines = ["| set/temp | method | before runs 1 / 2 / 3 | after runs 1 / 2 / 3 | after ÷ before | τ (all runs) |",
         "|---|---|---|---|---|---|"]
ratios, taus_equal, identical = [], True, True
for cell, methods in runs["before1"].items():
    for m in methods:
        tps = {n: runs[n][cell][m]["tokens_per_s"]["median"] for n in runs}
        tau = {n: runs[n][cell][m]["tau"]["median"] for n in runs}
        b = [tps[f"before{i}"] for i in (1, 2, 3)]; a = [tps[f"after{i}"] for i in (1, 2, 3)]
        ratio = statistics.median(a) / statistics.median(b); ratios.append(ratio)
        taus_equal &= len(set(tau.values())) == 1
        identical &= all(runs[n][cell][m].get("greedy_identical_to_ar") in (True, None) for n in runs)
        lines.append(f"| {cell} | {m} | {' / '.join(f'{x:.1f}' for x in b)} | {' / '.join(f'{x:.1f}' for x in a)} | {ratio:.3f} | {tau['before1']:.2f} |")
print("\n".join(lines))
print(f"\nafter ÷ before over {len(ratios)} cells: min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f}; every τ identical in all six runs: {taus_equal}; greedy output identical to ar in all six runs: {identical}")
# Paired: each after run against the before run next to it; pairs 1 and 3 are in opposite orders, so their geometric
# mean cancels a linear drift of the machine's speed.
paired = []
for cell, methods in runs["before1"].items():
    for m in methods:
        t = lambda n: runs[n][cell][m]["tokens_per_s"]["median"]
        paired.append(((t("after1") / t("before1")) * (t("after3") / t("before3"))) ** 0.5)
print(f"drift-cancelled (geometric mean of pair 1, after ran second, and pair 3, after ran first) over {len(paired)} cells: "
      f"min {min(paired):.3f}, median {statistics.median(paired):.3f}, max {max(paired):.3f}")

"""A test run's durations as markdown: the total, each test file's share and the 25 slowest tests, from the JUnit XML
pytest writes (`./scripts/test.sh [--fast|--full] --junitxml=run.xml`, then `python scripts/durations_report.py
run.xml --tier ci --wall-s 900 > results/test_durations/ci.md`). The CPU is named, as with every figure here."""
from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def report(junit: str, tier: str, wall_s: float | None, cpu: str) -> str:
    cases = [(c.get("classname"), c.get("name"), float(c.get("time") or 0.0))
             for c in ET.parse(junit).getroot().iter("testcase")]
    per_file: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for module, _, seconds in cases:
        per_file[module] += seconds
        count[module] += 1
    total = sum(per_file.values())
    lines = [f"# Test durations: tier `{tier}`", "",
             f"{len(cases)} tests, {total:.0f} s in tests" + (f", {wall_s:.0f} s wall (set-up included)" if wall_s
                                                              else "") + f", on {cpu}.", "",
             "| file | tests | seconds | share |", "|---|---:|---:|---:|"]
    lines += [f"| {module} | {count[module]} | {seconds:.1f} | {100 * seconds / total:.0f}% |"
              for module, seconds in per_file.most_common()]
    lines += ["", "Slowest 25:", "", "| seconds | test |", "|---:|---|"]
    lines += [f"| {seconds:.1f} | {module}::{name} |" for module, name, seconds in
              sorted(cases, key=lambda c: -c[2])[:25]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", help="pytest's --junitxml file")
    ap.add_argument("--tier", default="ci", choices=("fast", "ci", "full"))
    ap.add_argument("--wall-s", type=float, default=None, help="the run's wall time, as scripts/test.sh prints it")
    args = ap.parse_args(argv)
    from evospec.loading import cpu_description
    print(report(args.junit, args.tier, args.wall_s, cpu_description()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The suite's numeric tolerances against what they measured, per instruction set.

    ZEROFLAX_TOLERANCE_LOG=/tmp/sse.jsonl XLA_FLAGS=--xla_cpu_max_isa=SSE4_2 make test
    ZEROFLAX_TOLERANCE_LOG=/tmp/native.jsonl make test
    python tools/tolerance_audit.py /tmp/sse.jsonl /tmp/native.jsonl [--under 3]

Each line of a log is one check of tests/tolerance.py (the test, the check's name, the measured value, its
bound, the instruction set XLA was capped at). A check's margin is bound / measured for an upper bound and
measured / bound for a lower one (a difference that must show); the table gives each check's smallest
margin over its runs, per instruction set, smallest first. A claim (a loss that must fall, an estimator's
spread: a bound on something other than rounding) has for margin the gap between its bound and its worst
value over how far the value moved between instruction sets (the same test's spread), in the third table. A margin under 3 on any instruction set is the
issue's line to act on: widen the bound with a reason, measure it against a noise floor
(tests/noise_floor.py), or make the computation less sensitive. The second table gives the equivalence
tests' error over their noise floor (what tests/noise_floor.py's FACTOR must stay above).

Exit status 1 if --under is given and some check's margin is below it.

    python tools/tolerance_audit.py /tmp/native.jsonl --tests

prints instead the tests that made a bound on rounding (an upper or a lower one; not a claim), one pytest
node id a line; `--below 30` only those with such a bound whose margin is under 30x: .ci/run reruns those
under a narrower instruction set, not the whole suite (docs/tolerances.md says why 30).
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import sys


def margin(row: dict) -> float:
    measured, bound = row["measured"], row["bound"]
    if row["kind"] == "at_least":
        return measured / bound if bound > 0 else math.inf
    if measured <= 0:
        return math.inf
    return bound / measured if not math.isnan(measured) else 0.0


def read(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def rounding_tests(rows: list[dict], below: float | None = None) -> list[str]:
    """The node ids of the tests that made at least one bound on rounding, sorted; with `below`, only
    those with a bound whose margin (smallest over the runs logged) is under it."""
    return sorted({r["test"] for r in rows if r["kind"] in ("at_most", "at_least") and r["test"]
                   and (below is None or margin(r) < below)})


def tables(rows: list[dict], under: float | None = None, brief: bool = False) -> tuple[str, list[str]]:
    """(the markdown tables, the checks whose margin is below `under`); `brief`: only those checks' rows and
    the ten largest ratios to the noise floor."""
    isas = sorted({r["isa"] for r in rows})
    checks = collections.defaultdict(lambda: collections.defaultdict(list))
    ratios = collections.defaultdict(lambda: collections.defaultdict(list))
    claims = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        key = (r["site"], r["what"])
        {"info": ratios, "claim": claims}.get(r["kind"], checks)[key][r["isa"]].append(r)

    def cell(runs: list[dict]) -> str:
        if not runs:
            return "-"
        worst = min(runs, key=margin)
        sign = ">=" if worst["kind"] == "at_least" else "<="
        m = margin(worst)
        shown = "inf" if math.isinf(m) else f"{m:.3g}x"
        return f"{shown} ({worst['measured']:.3g} {sign} {worst['bound']:.3g}; {len(runs)} runs)"

    lines = [f"## Checks: smallest margin per instruction set ({len(checks)} checks, {sum(len(v) for c in checks.values() for v in c.values())} runs)", "",
             "| check | " + " | ".join(isas) + " |", "|---|" + "---|" * len(isas)]
    low = []
    order = sorted(checks, key=lambda k: min(margin(r) for runs in checks[k].values() for r in runs))
    for key in order:
        worst = min(margin(r) for runs in checks[key].values() for r in runs)
        if under is not None and worst < under:
            low.append(f"{key[0]}: {key[1]} ({worst:.3g}x)")
        elif brief:
            continue
        lines.append(f"| {key[0]}: {key[1]} | " + " | ".join(cell(checks[key][i]) for i in isas) + " |")
    if ratios:
        lines += ["", "## Equivalence: error / noise floor, largest per instruction set", "",
                  "| comparison | " + " | ".join(isas) + " |", "|---|" + "---|" * len(isas)]
        largest = sorted(ratios, key=lambda k: -max(r["measured"] for v in ratios[k].values() for r in v))
        for key in largest[:10] if brief else largest:
            row = [f"{max(r['measured'] for r in ratios[key][i]):.3g} ({len(ratios[key][i])} runs)"
                   if ratios[key][i] else "-" for i in isas]
            lines.append(f"| {key[0]}: {key[1]} | " + " | ".join(row) + " |")
    if claims:
        lines += ["", "## Claims: the gap to the bound over the value's spread between instruction sets",
                  "", "| check | worst | bound | spread between sets | gap / spread |", "|---|---|---|---|---|"]
        for key in sorted(claims):
            runs = [r for v in claims[key].values() for r in v]
            worst = max(r["measured"] for r in runs)
            by_test = collections.defaultdict(list)
            for r in runs:
                by_test[r["test"], r["what"]].append(r["measured"])
            spreads = [max(v) - min(v) for v in by_test.values() if len(v) > 1]
            gap = runs[0]["bound"] - worst
            spread = max(spreads) if spreads else None
            ratio = math.inf if spread == 0 else gap / spread if spread else None
            if under is not None and ratio is not None and ratio < under:
                low.append(f"{key[0]}: {key[1]} (gap {gap:.3g}, spread {spread:.3g})")
            shown = "one set only" if ratio is None else "inf" if math.isinf(ratio) else f"{ratio:.3g}x"
            lines.append(f"| {key[0]}: {key[1]} | {worst:.4g} | {runs[0]['bound']:.3g} | "
                         f"{'-' if spread is None else f'{spread:.3g}'} | {shown} |")
    return "\n".join(lines), low


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="ZEROFLAX_TOLERANCE_LOG files")
    parser.add_argument("--under", type=float, help="list the checks whose smallest margin is below this; exit 1 if any")
    parser.add_argument("--brief", action="store_true", help="with --under: only the checks below it")
    parser.add_argument("--tests", action="store_true",
                        help="print the node ids of the tests with a bound on rounding instead of the tables")
    parser.add_argument("--below", type=float,
                        help="with --tests: only the tests with a bound on rounding whose margin is below this")
    args = parser.parse_args(argv)
    if args.tests:
        tests = rounding_tests(read(args.logs), args.below)
        print("\n".join(tests))
        return 0 if tests else 1
    text, low = tables(read(args.logs), args.under, args.brief)
    print(text)
    if args.under is not None:
        print(f"\n{len(low)} check(s) with a margin under {args.under:g}x" + "".join(f"\n- {c}" for c in low))
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())

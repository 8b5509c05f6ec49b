"""Same numbers on any layout, as a table: each configuration of tests/layout_worker.py (ZeRO stages 0-3,
a pipe axis of 2, optimizer offload, 1-bit Adam) trained 5 steps on P processes x D simulated CPU devices,
against 1 process x P*D devices: the largest absolute difference of any parameter and whether it is bitwise.

    python benchmarks/layouts.py [--layouts 1x6,2x3,3x2,1x8,2x4] [--out layouts.md]

tests/test_layouts.py runs the N = 6 layouts (1x6, 2x3, 3x2) and asserts 1e-6; this adds N = 8 (1x8, 2x4),
about a minute more on 2 cores. Each layout is one worker launch (tests/layout_grid.py) that compiles every
configuration; a failing cell is printed as FAILED with its reason and makes the exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from layout_grid import compare, launch, parse, table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="1x6,2x3,3x2,1x8,2x4",
                        help="PxD layouts; each one's reference 1x(P*D) must be among them")
    parser.add_argument("--out", default=None, help="also write the table (markdown) here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per layout")
    args = parser.parse_args()
    layouts = [parse(name) for name in args.layouts.split(",")]
    seconds = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        for layout in layouts:
            seconds[layout.name] = launch(layout, os.path.join(root, layout.name), args.timeout)
            print(f"{layout.name}: {seconds[layout.name]:.1f} s", file=sys.stderr, flush=True)
        cells = compare(root, layouts)
    report = table(cells, seconds) + f"\ntotal {time.perf_counter() - start:.1f} s"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 1 if any(c.failure for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())

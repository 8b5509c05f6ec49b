"""Why one step of staleness costs Adam so much, and what each DPU prediction gives back: the largest
preconditioned curvature eta*h (eta = lr / sqrt(v)) on which momentum (b1 = 0.9, m = b1 m + (1 - b1) g,
x -= eta m) converges on the quadratic h x^2 / 2, when each gradient is taken at

    exact         x_t itself
    none          x_(t-1): DeepSpeed's DPU, one step stale
    extrapolate   x_(t-1) + (x_(t-1) - x_(t-2)): the last update repeated
    linear        where the pending update will put x: exact for this elementwise update

    python benchmarks/dpu_stability.py [--b1 0.9]

Pure numpy, instant; docs/offload.md quotes it. Adam trains near the edge of this range, so a smaller range
means flatter, slower-learning regions.
"""
from __future__ import annotations

import argparse

import numpy as np


def spectral_radius(eta_h: float, rule: str, b1: float) -> float:
    """The largest |eigenvalue| of one step on the state (x_t, x_(t-1), x_(t-2), eta m_(t-1))."""
    where = {"exact": (1, 0, 0), "none": (0, 1, 0), "extrapolate": (0, 2, -1)}[rule]
    step = np.zeros((4, 4))
    step[3, :3] = (1 - b1) * eta_h * np.asarray(where, float)  # eta m_t = b1 eta m_(t-1) + (1 - b1) eta h x_at
    step[3, 3] = b1
    step[0] = np.array([1.0, 0, 0, 0]) - step[3]  # x_(t+1) = x_t - eta m_t
    step[1, 0] = step[2, 1] = 1.0
    return float(max(abs(np.linalg.eigvals(step))))


def threshold(rule: str, b1: float) -> float:
    if rule == "linear":  # the gradient is taken where it is applied: the recurrence is the exact one
        rule = "exact"
    low, high = 1e-3, 1e3
    for _ in range(80):  # the stable range is an interval from 0 (checked: the radius grows past it)
        mid = (low + high) / 2
        low, high = (mid, high) if spectral_radius(mid, rule, b1) < 1 else (low, mid)
    return low


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--b1", type=float, default=0.9)
    args = parser.parse_args(argv)
    for rule in ("exact", "none", "extrapolate", "linear"):
        print(f"{rule:12s} stable for eta*h < {threshold(rule, args.b1):.2f}")


if __name__ == "__main__":
    main()

"""Draw the pipeline schedules that zeroflax executes, from the same tables the compiled step runs.

    pip install -e '.[docs]'   # matplotlib
    python scripts/plot_pipeline_schedules.py [--out docs/figures/pipeline_schedules.png]

One row per stage, one column per tick; a box is a forward (light) or backward (dark) of the micro-batch
whose number it carries (with its chunk, as m.v, for the interleaved schedule); blank cells are idle.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from zeroflax.pipeline.schedule import build_schedule  # noqa: E402

PANELS = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2)]


def draw(ax, schedule) -> None:
    import matplotlib
    from matplotlib.patches import Rectangle

    colours = matplotlib.colormaps["tab10"]
    for s in range(schedule.stages):
        for t, op in enumerate(schedule.ticks):
            cell = op[s]
            if cell is None:
                continue
            colour = colours(cell.micro % 10)
            alpha = 0.45 if cell.kind == "F" else 1.0
            ax.add_patch(Rectangle((t, s), 1, 1, facecolor=colour, alpha=alpha, edgecolor="black", linewidth=0.4))
            label = f"{cell.micro}" if schedule.virtual == 1 else f"{cell.micro}.{cell.chunk}"
            ax.text(t + 0.5, s + 0.5, label, ha="center", va="center", fontsize=6,
                    color="black" if cell.kind == "F" else "white")
    ax.set_xlim(0, schedule.num_ticks)
    ax.set_ylim(schedule.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(schedule.stages)])
    ax.set_yticklabels([f"stage {s}" for s in range(schedule.stages)], fontsize=7)
    ax.set_xticks(range(0, schedule.num_ticks + 1, 2))
    ax.tick_params(axis="x", labelsize=6)
    bubble = schedule.bubble_fraction()
    chunks = f", V={schedule.virtual}" if schedule.virtual > 1 else ""
    unit = f" of 1/{schedule.virtual} stage" if schedule.virtual > 1 else ""
    ax.set_title(f"{schedule.name} (S={schedule.stages}, M={schedule.micro_batches}{chunks}): "
                 f"{schedule.num_ticks} ticks{unit}, idle {bubble:.3f} per stage", fontsize=8)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join("docs", "figures", "pipeline_schedules.png"))
    args = parser.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schedules = [build_schedule(*panel) for panel in PANELS]
    fig, axes = plt.subplots(len(schedules), 1, figsize=(10, 1.3 * sum(s.stages for s in schedules) / 2.5))
    for ax, schedule in zip(axes, schedules):
        draw(ax, schedule)
    axes[-1].set_xlabel("tick (light: forward, dark: backward; the number is the micro-batch)", fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

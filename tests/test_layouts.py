"""Same numbers on any layout: every configuration of tests/layout_worker.py (ZeRO stages 0-3, one with 2
micro-batches; a pipe axis of 2; optimizer offload; 1-bit Adam past its freeze step), trained 5 steps on
an odd-shaped fp32 model, gives the same parameters on 2 processes x 3 devices and 3 x 2 (gloo, through
`zeroflax launch`) as on 1 process x 6 devices, within 1e-6 (max absolute difference); the table printed
(pytest -s) says which are bitwise. The pipeline runs in the mesh order each layout allows (the other order
is refused with a ConfigError, checked) and the two orders agree on 1 x 6. The table also counts the leaves
whose parameters ZeRO partitions over `data` (at stage 3 and under offload all of them, padded: no dimension
of this model divides 6 or 3; at stages 1-2 the optimizer state is). With Config.deterministic_reductions
('_ordered') the layouts must agree bit for bit, 1-bit Adam included. N = 8 (1x8, 2x4) is in
benchmarks/layouts.py, kept out of here for time: each layout is one worker launch that compiles every
configuration (about 10, 23 and 17 s on 2 idle cores)."""
import time

import pytest

from layout_grid import CONFIGS, compare, launch, parse, table

LAYOUTS = [parse(name) for name in ("1x6", "2x3", "3x2")]


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_every_configuration_gives_the_same_parameters_on_every_layout(tmp_path):
    seconds = {}
    start = time.perf_counter()
    for layout in LAYOUTS:
        seconds[layout.name] = launch(layout, str(tmp_path / layout.name), timeout_s=180)
    cells = compare(str(tmp_path), LAYOUTS)
    report = table(cells, seconds)
    print(f"\n{report}\ntotal {time.perf_counter() - start:.1f} s")
    failures = [f"{c.config}@{c.layout} vs {c.reference}: {c.failure}" for c in cells if c.failure]
    assert not failures, "\n".join(failures) + "\n\n" + report
    # Each layout really ran every configuration except its expected refusal; each refusal came.
    assert sorted((c.config, c.layout) for c in cells if c.refused) == [("pipeline_data_major", "2x3"),
                                                                        ("pipeline_pipe_major", "3x2")], report
    assert sum(c.diff is not None for c in cells) == 2 * len(CONFIGS) - 2 + 1, report  # + the orders on 1x6

"""Run as one of the processes of `zeroflax launch` by tests/test_onebit.py: the linear problem of test_onebit
at ZeRO stage 2 for 12 steps (freeze_step 4); process 0 writes the final parameters to argv[1] (.npz). argv[2]
'ordered': with Config.deterministic_reductions."""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +  # the suite's own flags, so its compiles are alike
                           f" --xla_force_host_platform_device_count={os.environ.get('ZEROFLAX_CPU_DEVICES', '8')}")
from zeroflax.distributed import maybe_initialize  # noqa: E402

maybe_initialize()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from test_onebit import N, engine_for, problem  # noqa: E402

STEPS = 12
_, grads = problem(STEPS)
engine, state = engine_for(2, ordered=sys.argv[2:] == ["ordered"])
index, count = engine.batch_share()
rows = N // count
for t in range(STEPS):
    state, _ = engine.step(state, {k: v[index * rows:(index + 1) * rows] for k, v in grads[t].items()})
params = {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in engine.model_params(state).items()}
if jax.process_index() == 0:
    np.savez(sys.argv[1], processes=jax.process_count(), **params)

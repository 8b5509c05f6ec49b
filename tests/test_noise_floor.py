"""The noise-floor bound of the equivalence tests (tests/noise_floor.py) still fails a wrong engine.

A bound that follows the reference's measured noise could, in principle, open up until anything passes.
Here the engine is made wrong on purpose, by patching its gradient source (zeroflax/step/accumulate.py)
for one test, and the check the equivalence tests make must fail by at least MARGIN times its bound:
- 'skipped micro-batch': device 0's micro-batch contributes no gradient (1 of the step's 8);
- 'loss scale x2': each loss is scaled by twice the step's weight, so every gradient comes out doubled
  (a wrong loss scale, or a mean over the wrong count).
Cases: the suite's MLP (tests/test_equivalence.py, AdamW, stage 2; its bound is noise_floor.MINIMUM) and
Flax's ImageNet ResNet (tests/test_real_models.py, stage 2), the real model with the loosest bound (its
BatchNorm biases give the largest noise floor of the suite).

Adam is invariant to a gradient's scale but for eps: a doubled gradient changes an update by about
eps / (2 |g|), so 'loss scale x2' is the harder mistake to see (measured: 30x the MLP's bound, 6.1x the
ResNet's on the whole vector and 716x on its worst leaf, 303x under SSE4.2). With clipping active at every step the doubled
gradient is clipped to the same vector and the run is bitwise the same: no equivalence test can see that
mistake there, which is why the clipped case is not among these.
"""
import jax
import pytest

import zeroflax
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.step.accumulate import Accumulation
import test_equivalence as eq
import test_real_models as real
from noise_floor import excess
from tolerance import at_least, relative_error

ORIGINAL = Accumulation.__call__
MARGIN = 5


def skipped_micro_batch(self, trace, params, micro, rng, seed, model_state, sources, per_microbatch):
    def drop_device_0(grads):
        keep = jax.lax.axis_index(DATA_AXIS) != 0
        return per_microbatch(jax.tree.map(lambda g: g * keep.astype(g.dtype), grads))
    return ORIGINAL(self, trace, params, micro, rng, seed, model_state, sources, drop_device_0)


def doubled_loss_scale(self, trace, params, micro, rng, seed, model_state, sources, per_microbatch):
    return ORIGINAL(self, trace, params, micro, rng, seed * 2, model_state, sources, per_microbatch)


MUTATIONS = {"skipped micro-batch": skipped_micro_batch, "loss scale x2": doubled_loss_scale}


def run(case):
    """(zeroflax's parameters, the reference's, its noise floor) of one case at stage 2."""
    if case == "imagenet":
        c = real.case("imagenet")
        engine, state = real._initialize(c, zero_stage=2)
        for batch in c.batches:
            state, _ = engine.step(state, batch)
        return (jax.device_get(engine.model_params(state)), real.reference_params("imagenet"),
                real.reference_floor("imagenet"))
    boxed, loss, batches = eq.make_case("mlp", 0)
    config = zeroflax.Config(zero_stage=2, micro_batch_size=4, persistence_threshold=0)
    params, _ = eq.engine_run(loss, boxed, eq.OPTIMIZERS["adamw_wd"](), batches, config)
    return (params, *eq.expected("mlp", "adamw_wd", 0))


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("case", ["mlp", "imagenet"])
def test_a_wrong_engine_fails_the_equivalence_check(case, mutation, monkeypatch):
    monkeypatch.setattr(Accumulation, "__call__", MUTATIONS[mutation])
    params, reference, floor = run(case)
    whole, leaf, _ = excess(params, reference, floor)
    print(f"{case}, {mutation}: relative error {relative_error(params, reference):.2e}, bound {floor.bound:.2e}; "
          f"the whole vector at {whole:.3g}x its bound, the worst leaf at {leaf:.3g}x")
    at_least(max(whole, leaf), MARGIN, "a wrong engine's error over its bound")


def test_a_leaf_without_signal_is_judged_only_within_the_whole():
    """A leaf the reference does not reproduce itself (floor above LEAF_CEILING) is not judged alone, any
    other leaf is: the same error on a leaf with a tight floor fails."""
    import numpy as np
    from noise_floor import LEAF_CEILING, Floor

    reference = {"a": np.ones(4, np.float32), "b": np.full(4, 1e-3, np.float32)}
    params = {"a": np.ones(4, np.float32), "b": np.full(4, -1e-3, np.float32)}  # b off by 200%
    noisy = Floor(whole=1e-7, leaves=(1e-8, 2 * LEAF_CEILING))
    tight = Floor(whole=1e-7, leaves=(1e-8, 1e-8))
    assert excess(params, reference, noisy)[1] == 0.0
    at_least(excess(params, reference, tight)[1], 1.0, "the same leaf with a tight floor fails")

"""The memory and communication reports on a data size that divides no dimension (issue 29): their theories
count the padding ZeRO stores and moves, and the memory report names the leaves held whole over `data`."""
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.memory import leaf_sections, whole_reason
from zeroflax.sharding.policy import LeafPlacement

N = 6
PARAMS = {"w1": jnp.ones((13, 37)), "w2": jnp.ones((37, 11)), "b": jnp.ones((11,))}
LAYER = zeroflax.group(lambda p, x: (x @ p["w1"]) @ p["w2"] + p["b"], name="layer")
COUNT_EXCESS = 4 * (1 - 1 / N)  # Adam's int32 step count, whole on every device


def loss(params, batch, rng):
    return jnp.mean(LAYER(params, batch["x"]) ** 2)


@pytest.fixture(scope="module")
def built():
    cache = {}

    def build(stage, threshold=0, devices=N):
        if (stage, threshold, devices) not in cache:
            config = zeroflax.Config(zero_stage=stage, micro_batch_size=2, persistence_threshold=threshold)
            engine, state = zeroflax.initialize(loss, PARAMS, optax.adam(1e-3), config,
                                                devices=jax.devices()[:devices])
            batch = {"x": np.zeros((config.resolve_train_batch(devices), 13), np.float32)}
            cache[stage, threshold, devices] = engine, state, batch
        return cache[stage, threshold, devices]
    return build


@pytest.mark.parametrize("stage", [1, 3])
def test_memory_theory_counts_the_padding(built, stage):
    """N=6 divides no dimension of (13, 37) or (37, 11): both are stored padded (to (13, 42) and (37, 12)), and
    the theory's 1/N is of the stored bytes, so it equals the measured bytes at rest (less Adam's count, the
    one state held whole)."""
    engine, state, batch = built(stage)
    report = zeroflax.memory_report(engine, state, batch)
    assert engine.plan.padded
    assert report.num_params == 13 * 37 + 37 * 11 + 11  # Psi is the true count
    assert report.whole_excess == pytest.approx(COUNT_EXCESS)
    assert report.at_rest == pytest.approx(report.theory_at_rest + report.whole_excess, abs=1e-6)
    # The padding: Adam's two fp32 slots (and at stage 3 the fp32 parameter) of every padded leaf, over N.
    copies = 3 if stage == 3 else 2
    assert report.padded_leaves["['w1']"]["stored"] == [13, 42]
    assert report.padded_leaves["['w2']"]["stored"] == [37, 12]
    assert report.padded_leaves["['b']"]["stored"] == [12]
    zeros = 13 * 5 + 37 * 1 + 1
    assert report.padding == pytest.approx(zeros * 4 * copies / N)
    true_share = copies * 4 * report.num_params / N + (4 * report.num_params if stage == 1 else 0) + 4 / N
    assert report.at_rest - true_share == pytest.approx(report.padding + COUNT_EXCESS)
    assert not report.whole_leaves
    text = str(report)
    assert "padded leaves (N=6" in text and "(13, 37) -> (13, 42)" in text
    json.dumps(report.to_dict())


def test_memory_report_names_the_leaves_held_whole(built):
    engine, state, batch = built(3, threshold=20)
    report = zeroflax.memory_report(engine, state, batch)
    assert set(report.whole_leaves) == {"['b']"}
    whole = report.whole_leaves["['b']"]
    assert "persistence_threshold" in whole["reason"]
    assert whole["bytes"] == 11 * 4 * 3  # the fp32 bias and Adam's two slots, whole on this device
    assert report.whole_excess == pytest.approx(11 * 4 * 3 * (1 - 1 / N) + COUNT_EXCESS)
    assert report.at_rest == pytest.approx(report.theory_at_rest + report.whole_excess, abs=1e-6)
    text = str(report)
    assert "held whole over data: 1 leaf" in text and "below persistence_threshold (11 < 20 elements)" in text


def test_why_a_leaf_stays_whole(built):
    engine, _, _ = built(3, devices=1)
    sections = leaf_sections(engine)
    assert {row["reason"] for row in sections["whole_leaves"].values()} == {"data size 1"}
    assert sections["whole_excess"] == 0 and sections["padding"] == 0
    sliced = LeafPlacement((8, 16), ("tensor", "tensor"), None, False)
    assert whole_reason(sliced, 6, 0).startswith("every dimension already partitioned")
    assert whole_reason(LeafPlacement((), (), None, False), 6, 0) == "a scalar"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_comm_theory_counts_the_padding(built, stage):
    """The reduce-scatters and all-gathers move the padded shards; the theory moves them too. Beyond them
    the step all-reduces a few scalars (the loss), hence the small slack; without the padding the theory
    would be about 10% short here."""
    engine, state, batch = built(stage)
    report = zeroflax.comm_report(engine, state, batch)
    assert report.padded_params == 13 * 5 + 37 * 1 + 1
    assert abs(report.ratio - 1) < 0.01, str(report)
    true_theory = report.theory_bytes - report.padding_bytes
    assert report.total_bytes / true_theory > 1.08
    gathered = {tuple(c["dims"]) for c in report.collectives if c["kind"] == "all-gather"}
    assert {(13, 42), (37, 12)} <= gathered
    assert "of it padding" in str(report)
    assert math.isfinite(report.to_dict()["ratio"])

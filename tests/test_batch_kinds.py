"""Every entry point that takes a batch takes it in every form a user has one (zeroflax/batch.py): numpy
arrays, a jax array on one device (`jax.random`), arrays already placed (as the step lays them out, or
otherwise), and ShapeDtypeStructs (with or without a sharding of their own). Each form gives the same
compiled step, reports and losses as numpy data."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

import zeroflax
from zeroflax import explain
from models import MLP, linen_case

ROWS = 8  # micro-batch 1 x 8 data-parallel devices


@pytest.fixture(scope="module")
def setup():
    init, loss, make_batch = linen_case(MLP(hidden=16, out=4), (12,), 4)
    batch = make_batch(np.random.default_rng(0), ROWS)
    config = zeroflax.Config(zero_stage=3, micro_batch_size=1, persistence_threshold=0)
    engine, state = zeroflax.initialize(loss, init, optax.adamw(1e-2), config, sample_batch=batch)
    mesh = engine.mesh
    one_device = SingleDeviceSharding(jax.devices()[3])
    kinds = {
        "numpy": batch,
        "jax_one_device": {"x": jax.random.normal(jax.random.key(1), (ROWS, 12)),
                           "y": jnp.asarray(batch["y"])},
        "placed": jax.device_put(batch, NamedSharding(mesh, P("data"))),
        "placed_replicated": jax.device_put(batch, NamedSharding(mesh, P())),
        "abstract": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch),
        "abstract_one_device": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
                                            batch),
    }
    kinds["jax_one_device"]["x"] = jax.device_put(kinds["jax_one_device"]["x"], one_device)
    return engine, state, kinds, reports(engine, state, batch)


def reports(engine, state, batch):
    """What each entry point returns for `batch`, in comparable form."""
    layers = zeroflax.memory_report(engine, state, batch, by="layer")
    return {"compile": engine.compile(state, batch),
            "memory": zeroflax.memory_report(engine, state, batch).to_dict(),
            "comm": zeroflax.comm_report(engine, state, batch).to_dict(),
            "layers": layers.to_dict(), "layer_arguments": (layers.arguments, layers.arguments_xla),
            "timeline": explain.step_timeline(engine, state, batch)}


KINDS = ["numpy", "jax_one_device", "placed", "placed_replicated", "abstract", "abstract_one_device"]


@pytest.mark.parametrize("kind", KINDS)
def test_reports_take_every_batch_kind(setup, kind):
    engine, state, kinds, base = setup
    got = base if kind == "numpy" else reports(engine, state, kinds[kind])
    # compile: the same executable (the cache is keyed by shapes, dtypes and shardings, so a batch
    # abstracted to another layout would compile anew)
    assert got["compile"] is base["compile"]
    for what in ("memory", "comm", "layers", "timeline"):
        assert got[what] == base[what], what
    arguments, arguments_xla = got["layer_arguments"]
    assert arguments == arguments_xla > 0  # the batch charged from its sharding as XLA lays it out
    assert got["timeline"] and got["memory"]["batch"] > 0


def _fresh(state):
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)


def test_step_takes_every_concrete_kind(setup):
    engine, state, kinds, _ = setup
    loss = {}
    for kind in ("numpy", "placed", "placed_replicated"):
        _, metrics = engine.step(_fresh(state), kinds[kind])
        loss[kind] = float(metrics["loss"])
    assert loss["numpy"] == loss["placed"] == loss["placed_replicated"]
    # The jax array on one device holds other x values: it runs, with its own loss.
    _, metrics = engine.step(_fresh(state), kinds["jax_one_device"])
    assert np.isfinite(float(metrics["loss"])) and float(metrics["loss"]) != loss["numpy"]
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):
        engine.step(_fresh(state), kinds["abstract"])


@pytest.mark.parametrize("form", ["numpy", "jax", "abstract"])
def test_wrong_rows_name_train_batch_size(setup, form):
    engine, state, kinds, _ = setup
    short = jax.tree.map(lambda x: x[: ROWS - 1], kinds["numpy"])
    if form == "jax":
        short = jax.tree.map(jnp.asarray, short)
    elif form == "abstract":
        short = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), short)
    with pytest.raises(zeroflax.ConfigError, match="train_batch_size"):
        zeroflax.memory_report(engine, state, short)

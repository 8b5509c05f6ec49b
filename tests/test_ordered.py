"""The ordered sums over a mesh axis (zeroflax.sharding.ordered, Config.deterministic_reductions): psum's and
psum_scatter's results within rounding, and bitwise the left-to-right sum in device order, whatever order the
collective library would add in. That order is what makes 1 x 8 and 2 x 4 agree bitwise
(benchmarks/onebit_layout.py measures it across processes; docs/onebit_adam.md)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import zeroflax
from zeroflax.sharding.ordered import ordered_global_norm, ordered_psum, ordered_psum_scatter
from tolerance import at_most, close

N = 8


def per_device(shape, seed=0):
    """N arrays whose sum depends on the order of the additions: magnitudes over 12 decades, both signs."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N,) + shape) * 10.0 ** rng.integers(-6, 6, size=(N,) + shape)
    return x.astype(np.float32)


def in_order(x, order=range(N)):
    order = list(order)
    total = x[order[0]].copy()
    for k in order[1:]:
        total = total + x[k]
    return total


def on_devices(fn, x):
    """fn on each device's x[k] (the leading dimension split over `data`), the results stacked."""
    mesh = jax.make_mesh((N,), ("data",))
    run = jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    return np.asarray(run(jax.device_put(x, NamedSharding(mesh, P("data")))))


def test_the_data_is_order_sensitive():
    """Without this the bitwise checks below could not fail: another order gives other bits."""
    x = per_device((16, 24))
    assert not np.array_equal(in_order(x), in_order(x, reversed(range(N))))
    assert not np.array_equal(in_order(x), in_order(x, [3, 1, 4, 0, 5, 2, 7, 6]))


@pytest.mark.parametrize("dimension", [0, 1])
def test_reduce_scatter_is_the_sum_in_device_order(dimension):
    x = per_device((16, 24))
    got = on_devices(lambda v: ordered_psum_scatter(v, "data", dimension), x)
    whole = np.concatenate(list(got), axis=dimension)  # device i holds block i
    np.testing.assert_array_equal(whole, in_order(x))
    library = on_devices(lambda v: jax.lax.psum_scatter(v, "data", scatter_dimension=dimension, tiled=True), x)
    scale = np.abs(x).sum(0)  # the rounding of any order is within a few ulps of the summands' magnitude
    at_most(np.max(np.abs(np.concatenate(list(library), axis=dimension) - whole) / scale), 1e-6,
            "psum_scatter against the ordered sum, in units of the summands' magnitude")


@pytest.mark.parametrize("shape", [(16, 24), (5, 3), ()])
def test_all_reduce_is_the_sum_in_device_order_on_every_device(shape):
    """Padded to a multiple of N where it is not one (15 elements, a scalar)."""
    x = per_device(shape, seed=1)
    got = on_devices(lambda v: ordered_psum(v, "data"), x)
    for k in range(N):
        np.testing.assert_array_equal(got[k], in_order(x))
    library = on_devices(lambda v: jax.lax.psum(v, "data"), x)
    at_most(np.max(np.abs(library - got) / np.abs(x).sum(0)), 1e-6,
            "psum against the ordered sum, in units of the summands' magnitude")


def test_the_norm_adds_the_split_leaves_parts_in_order_and_the_whole_leaves_once():
    split, whole = per_device((4, 6), seed=2), np.float32(3) * np.ones((5,), np.float32)
    got = on_devices(lambda v: ordered_global_norm([v], [jnp.asarray(whole)], "data"), split)
    parts = np.stack([np.sum(np.square(split[k])) for k in range(N)])
    expected = np.sqrt(np.float64(in_order(parts)) + 45.0)
    close(got, np.full(N, expected), rtol=1e-6, what="the ordered global norm against float64")
    assert len(set(got.tolist())) == 1


def linear_loss(params, batch, rng):
    return sum(jnp.mean(jnp.sum((params[k] * batch[k]).reshape(batch[k].shape[0], -1), axis=1)) for k in params)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_engine_with_ordered_reductions_takes_the_same_steps(stage):
    """AdamW with clipping, the (240, 50) leaf partitioned and the (13,) one replicated: the parameters and
    gradient norms of 3 steps equal psum's run within rounding; the ordered step moves the same bytes over
    `data` (within 0.2%: the padding of the (13,) leaf and of the norm and loss to multiples of 8) in
    all-to-alls and all-gathers, no reduce-scatter or all-reduce left."""
    rng = np.random.default_rng(0)
    params = {"a": rng.normal(size=(13,)).astype(np.float32), "c": rng.normal(size=(240, 50)).astype(np.float32)}
    grads = [{k: rng.normal(size=(N,) + v.shape).astype(np.float32) for k, v in params.items()} for _ in range(3)]
    runs = {}
    for ordered in (False, True):
        config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=0, grad_clip=2.0,
                                 remat="none", deterministic_reductions=ordered)
        engine, state = zeroflax.initialize(linear_loss, params, optax_adamw(), config)
        report = zeroflax.comm_report(engine, state, grads[0])
        norms = []
        for g in grads:
            state, metrics = engine.step(state, g)
            norms.append(float(metrics["grad_norm"]))
        runs[ordered] = state, norms, report
    (plain, plain_norms, plain_report), (ordered, ordered_norms, ordered_report) = runs[False], runs[True]
    for k in params:
        close(ordered.params[k], plain.params[k], atol=1e-6, what="ordered reductions' parameters against psum's")
    close(ordered_norms, plain_norms, rtol=1e-6, what="ordered reductions' gradient norms against psum's")
    assert max(plain_norms) > 2.0  # the clip acted
    assert "reduce-scatter" in plain_report.by_kind and "all-reduce" in plain_report.by_kind
    assert set(ordered_report.by_kind) == {"all-to-all", "all-gather"}
    assert abs(ordered_report.by_axis["data"] / plain_report.by_axis["data"] - 1) < 0.002, (
        str(plain_report), str(ordered_report))


def optax_adamw():
    import optax
    return optax.adamw(1e-2, weight_decay=0.01)


@pytest.mark.parametrize("change", [dict(zero_stage=3, remat="full"), dict(precision="fp16"),
                                    dict(mesh=zeroflax.MeshConfig(axes={"data": 4, "tensor": 2})),
                                    dict(zero_stage=1, offload_optimizer=zeroflax.OffloadOptimizerConfig(device="cpu")),
                                    dict(deterministic_reductions=1)])
def test_refusals_name_the_key(change):
    with pytest.raises(zeroflax.ConfigError, match="Config.deterministic_reductions"):
        zeroflax.Config(**{"deterministic_reductions": True, **change})

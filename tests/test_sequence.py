"""A `sequence` mesh axis (zeroflax/sharding/sequence.py): each example's tokens split over its devices, with
attention by DeepSpeed-Ulysses or ring attention, at every ZeRO stage and beside tensor slicing and a pipeline.

Every training case is checked against the plain single-device optax loop in float32 (tests/test_equivalence.py's
reference, within its own rounding noise: tests/noise_floor.py), from fixed seeds, on 8 simulated devices. A wrong split (a slice taken twice, a
position offset, a loss averaged over the wrong devices, a gradient not summed over the sequence axis) is off by
the parameters' movement itself, orders of magnitude above the tolerance.
"""
import jax
import numpy as np
import pytest

import zeroflax
from zeroflax import Config, ConfigError, MeshConfig
from zeroflax.kernels import BigBirdSparsityConfig
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from noise_floor import assert_matches
from test_equivalence import adamw, reference_and_floor

STEPS = 3
ROWS = 8  # examples per step


def gpt_case(seq: int = 16, heads: int = 4, attention: str = "dense", sparsity=None, seed: int = 0):
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=heads, max_len=seq, attention=attention,
                          sparsity=sparsity))
    rng = np.random.default_rng(seed)
    batches = [{"tokens": rng.integers(0, 256, size=(ROWS, seq + 1)).astype(np.int32)} for _ in range(STEPS)]
    params = model.init(jax.random.PRNGKey(seed), batches[0]["tokens"][:, :-1])["params"]
    return params, next_token_loss(model), batches


def sequence_config(stage: int, attention: str, sequence: int = 4, tensor: int = 1, pipe: int = 1, **kwargs) -> Config:
    axes = {"pipe": pipe} if pipe > 1 else {}
    axes.update({"data": -1, "sequence": sequence, "tensor": tensor})
    data = 8 // (pipe * sequence * tensor)
    accum = 2 if pipe > 1 else 1
    return Config(mesh=MeshConfig(axes), zero_stage=stage, micro_batch_size=ROWS // (data * accum),
                  grad_accum_steps=accum, persistence_threshold=0, sequence_attention=attention, **kwargs)


def trained(params, loss, batches, config):
    engine, state = zeroflax.initialize(loss, params, adamw(weight_decay=0.1), config)
    for batch in batches:
        state, metrics = engine.step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    return jax.device_get(engine.model_params(state)), engine, state


_EXPECTED = {}  # id(loss) -> (the case, reference parameters, noise floor): a case's reference is run once


def check_against_optax(case, config):
    params, loss, batches = case
    if id(loss) not in _EXPECTED:  # the case itself is kept, so the id is not reused
        _EXPECTED[id(loss)] = (case, *reference_and_floor(loss, zeroflax.unbox(params)[0], adamw(weight_decay=0.1),
                                                          batches))
    _, reference, floor = _EXPECTED[id(loss)]
    got, engine, state = trained(params, loss, batches, config)
    assert_matches(got, reference, floor, f"sequence axis {config.sequence_attention}")
    return engine, state


@pytest.fixture(scope="module")
def dense_case():
    return gpt_case()


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sequence_axis_matches_optax(dense_case, attention, stage):
    """data 2 x sequence 4, causal GPT: the same parameters as one device; at stage 3 the parameters are
    partitioned over data x sequence (1/8 on each device), not over data alone."""
    engine, state = check_against_optax(dense_case, sequence_config(stage, attention))
    usage = engine.gather_usage
    assert usage.sequence_slices == 3 and usage.sequence_attentions == 1  # tokens, positions, targets; the scanned layer
    if stage == 3:
        w, placement = state.params["w_in"], engine.plan.placements["w_in"]  # the stacked MLP-in weights
        assert w.sharding.spec[placement.zero_dim] == ("data", "sequence")
        assert w.addressable_shards[0].data.size * 8 == w.size


def test_ulysses_runs_block_sparse_attention_per_head():
    """Ulysses with a BigBird layout that differs per head: each device runs its own heads' layout."""
    sparsity = BigBirdSparsityConfig(num_heads=4, block=4, different_layout_per_head=True)
    check_against_optax(gpt_case(seq=32, attention="sparse", sparsity=sparsity), sequence_config(3, "ulysses"))


@pytest.mark.parametrize("attention", ["ulysses", "ring"])
def test_sequence_beside_tensor(dense_case, attention):
    """data 2 x sequence 2 x tensor 2 at stage 3 (Ulysses on each tensor slice's heads)."""
    check_against_optax(dense_case, sequence_config(3, attention, sequence=2, tensor=2))


def test_ulysses_beside_a_pipeline_and_ring_refused_there(dense_case):
    """pipe 2 x data 2 x sequence 2 at stage 1 (1F1B, 2 micro-batches) with Ulysses; ring attention is refused
    under a pipeline (zeroflax/step/build.py says why: on the CPU it gave wrong parameters, not an error)."""
    check_against_optax(dense_case, sequence_config(1, "ulysses", sequence=2, pipe=2))
    params, loss, _ = dense_case
    with pytest.raises(ConfigError, match=r"Config.sequence_attention.*'ring' under a pipeline"):
        zeroflax.initialize(loss, params, adamw(), sequence_config(1, "ring", sequence=2, pipe=2))


def test_refusals_name_the_key(dense_case):
    params, loss, batches = dense_case
    with pytest.raises(ConfigError, match=r"Config.sequence_attention.*8 devices.*4 heads"):
        trained(params, loss, batches[:1], sequence_config(0, "ulysses", sequence=8))
    with pytest.raises(ConfigError, match=r"MeshConfig.axes\['sequence'\].*12 positions.*8 equal pieces"):
        case = gpt_case(seq=12)
        trained(case[0], case[1], case[2][:1], sequence_config(0, "ring", sequence=4))
    sparsity = BigBirdSparsityConfig(num_heads=4, block=4)
    case = gpt_case(seq=32, attention="sparse", sparsity=sparsity)
    with pytest.raises(ConfigError, match=r"Config.sequence_attention.*'ring'.*block-sparse"):
        trained(case[0], case[1], case[2][:1], sequence_config(0, "ring"))
    with pytest.raises(ConfigError, match="Config.sequence_attention"):
        Config(sequence_attention="striped")
    with pytest.raises(ConfigError, match="Config.sequence_parallel"):
        Config(mesh=MeshConfig({"data": -1, "sequence": 2, "tensor": 2}), sequence_parallel=True)
    with pytest.raises(ConfigError, match="Config.logical_rules"):
        Config(mesh=MeshConfig({"data": -1, "sequence": 2, "tensor": 1}), logical_rules=(("embed", "sequence"),))
    with pytest.raises(ConfigError, match=r"MeshConfig.axes\['sequence'\].*1-bit Adam"):
        zeroflax.initialize(loss, params, zeroflax.optim.onebit_adam(1e-3), sequence_config(1, "ulysses"))


def test_a_loss_that_takes_no_slice_is_correct_and_warned():
    """A loss that never calls sequence_slice computes the whole sequence on every device of a group: the
    result is still the single device's, and the engine says that nothing was saved."""
    rng = np.random.default_rng(3)
    w0 = {"w": rng.normal(size=(6, 6)).astype(np.float32)}
    loss = lambda p, b, r: ((b["x"] @ p["w"]) ** 2).mean()
    batches = [{"x": rng.normal(size=(ROWS, 6)).astype(np.float32)} for _ in range(STEPS)]
    with pytest.warns(UserWarning, match="takes no slice with zeroflax.sequence_slice"):
        check_against_optax((w0, loss, batches), sequence_config(2, "ulysses", remat="none"))


def test_deepspeed_sequence_parallel_size_is_the_sequence_axis():
    result = zeroflax.from_deepspeed({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                                      "train_batch_size": 4, "sequence_parallel_size": 4,
                                      "zero_optimization": {"stage": 3}}, world_size=2)
    assert result.config.mesh.axes["sequence"] == 4 and result.config.mesh.axes["data"] == 2
    assert result.num_devices == 8 and result.config.sequence_attention == "ulysses"
    assert any("sequence_parallel_size 4" in note for note in result.notes)
    with pytest.raises(ConfigError, match="sequence_parallel_size"):
        zeroflax.from_deepspeed({"sequence_parallel_size": 0})
    with pytest.raises(ConfigError, match="sequence_parallel_size.*bound"):
        zeroflax.from_deepspeed({"sequence_parallel_size": 2}, bound={"MeshConfig.axes": {"data": -1, "sequence": 4,
                                                                                          "tensor": 1}})


@pytest.mark.parametrize("attention,remat", [("ulysses", "full"), ("ulysses", "none"), ("ring", "full"),
                                             ("ring", "none")])
def test_sequence_bytes_match_the_theory(attention, remat):
    """The compiled step's all-to-all (Ulysses) or collective-permute (ring) bytes over `sequence` against
    comm.sequence_axis_bytes: 4 all-to-alls per layer each way, or S-1 key/value sends forward and the
    backward's S-1 key/value and S float32 dk/dv sends; a remat policy adds the recomputed forward's."""
    params, loss, batches = gpt_case(seq=32)
    engine, state = zeroflax.initialize(loss, params, adamw(), sequence_config(2, attention, remat=remat))
    report = zeroflax.comm_report(engine, state, batches[0])
    kinds = {c["kind"] for c in report.collectives if c["axes"] == ["sequence"] or c["axes"] == ("sequence",)}
    assert kinds == {"all-to-all" if attention == "ulysses" else "collective-permute"}
    measured, theory = report.by_axis["sequence"], report.theory_by_axis["sequence"]
    print(f"{attention} remat {remat}: {measured:.0f} B over sequence, theory {theory:.0f} B")
    assert 1 / 1.1 <= measured / theory <= 1.1
    assert 1 / 1.1 <= report.by_axis["data+sequence"] / report.theory_by_axis["data+sequence"] <= 1.1


def test_activations_per_device_fall_with_the_sequence_axis():
    """The compiled step's temporaries (activations, mostly) with data 2 and a sequence axis of 1, 2 and 4 (on
    2, 4 and 8 devices: the same examples per data shard, 1/S of their tokens per device): each doubling of
    the sequence axis takes at least a third off. The memory report's N is data x sequence, and its model
    states match ZeRO's formula."""
    params, loss, batches = gpt_case(seq=128)
    temps = {}
    for sequence in (1, 2, 4):
        config = Config(mesh=MeshConfig({"data": 2, "sequence": sequence, "tensor": 1}), zero_stage=3,
                        micro_batch_size=ROWS // 2, persistence_threshold=0, sequence_attention="ring", remat="full")
        engine, state = zeroflax.initialize(loss, params, adamw(), config, devices=jax.devices()[:2 * sequence])
        report = zeroflax.memory_report(engine, state, batches[0])
        assert report.data_size == 2 * sequence and report.sequence_size == sequence
        assert 0.9 <= report.ratio <= 1.1
        temps[sequence] = report.temp
    print({s: round(t / 2**20, 3) for s, t in temps.items()})
    assert temps[2] <= 0.67 * temps[1] and temps[4] <= 0.67 * temps[2]


def test_the_planner_chooses_a_sequence_axis(tmp_path):
    """`zeroflax plan --sequence 1,8` on a sequence of 4096 tokens, a budget one device's whole sequence
    exceeds: the winner splits it over 8 devices, the written gin file binds the axis, and the data-parallel
    candidate is rejected (by the peak model or its compile)."""
    import gin
    import json
    from zeroflax import cli
    from cli_helpers import TINY, tiny_bindings
    out, report = tmp_path / "plan.gin", tmp_path / "plan.json"
    args = ["plan", "--gin_file", TINY, *tiny_bindings(tmp_path / "run"), "--gin_param", "TrainConfig.seq_len = 4096",
            "--gin_param", "GPTConfig.max_len = 4096", "--gin_param", "Config.train_batch_size = 8",
            "--gin_param", "Config.sequence_attention = 'ring'", "--device-memory", "24MiB", "--sequence", "1,8",
            "--stages", "3", "--offload", "none", "--remat", "full", "--tensor", "1", "--micro-batches", "1",
            "--out", str(out), "--json", str(report), "--no_progress"]
    try:
        assert cli.main(args) == 0
    finally:
        gin.clear_config()
    result = json.loads(report.read_text())
    assert result["winner"]["sequence"] == 8 and result["winner"]["device_peak"] <= result["budget"]
    others = [c for c in result["candidates"] if c["sequence"] == 1]
    assert others and all(c["status"] in ("pruned", "over budget") for c in others)
    assert "'sequence': 8" in out.read_text()

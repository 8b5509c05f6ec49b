"""The memory explainer: every byte of memory_analysis' total charged to a layer and a category."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from cli_helpers import ROOT, zeroflax as run_cli
from zeroflax import buffer_assignment, explain
from zeroflax.models.gpt import GPTConfig
from zeroflax.models.unet3d import UNet3D, UNet3DConfig, segmentation_loss
from zeroflax.plan import abstract_gpt_engine

# A hand-written dump in XLA's formats: one parameter, one temporary buffer of three values in two regions.
ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <0 p.1 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 96, preallocated-temp:
 value: <1 big.2 @0> (size=64,offset=0): f32[16]{0}
 value: <2 small.3 @0> (size=32,offset=0): f32[8]{0}
 value: <3 other.4 @0> (size=32,offset=64): f32[2,4]{1,0}
allocation 2: size 4, thread-local:
 value: <4 t.5 @0> (size=4,offset=0): f32[]

Total bytes used: 164
"""
VALUES = """<1 big.2 @0>
 positions:
  big.2
 from instruction: %big.2 = f32[16]{0} fusion(%p.1), kind=kLoop, metadata={op_name="jit(f)/jvp(M)/zeroflax_layers[2]/x"}
<2 small.3 @0>
 from instruction: %small.3 = f32[8]{0} all-gather(%p.1), metadata={op_name="jit(f)/jvp(M)/zeroflax_group[enc/conv]/all_gather"}
<3 other.4 @0>
 from instruction: %other.4 = (f32[2,4]{1,0}) tuple(%small.3)
"""
LIVE = """HloLiveRange (max 9):
  BufferLiveRange:
    big.2{}:1-2
    small.3{}:4-8
    other.4{}:0-9
  Live ranges at 4 (peak):
"""


def test_parse_dump_and_charge_each_byte_once():
    allocations = buffer_assignment.parse_buffer_dump(ASSIGNMENT, VALUES, LIVE)
    assert [(a.index, a.size, a.working) for a in allocations] == [(0, 64, False), (1, 96, True), (2, 4, False)]
    big, small, other = allocations[1].values
    assert (big.dims, big.start, big.end, big.opcode) == ((16,), 1, 2, "fusion")
    assert (small.opcode, small.op_name.endswith("all_gather"), small.start) == ("all-gather", True, 4)
    assert other.dims == (2, 4) and other.op_name == ""
    # The worst moment: small (32) and other (32) live at 4-8; big (64) and other at 1-2 hold more: 96.
    assert buffer_assignment.peak_live(allocations) == (96, 1)
    # At moment 1 big owns bytes 0-64 (small is not live then); at moment 5 small owns 0-32 and the
    # rest of the region goes to its longest occupant, big.
    assert buffer_assignment.charge_regions(allocations[1], 1) == {1: 64, 3: 32}
    assert buffer_assignment.charge_regions(allocations[1], 5) == {2: 32, 1: 32, 3: 32}
    owners = explain.Owners(rows=[], by_path={}, stacks={2: "layers"}, groups=["enc/conv"], grad_dims=set(),
                            by_dims={})
    assert explain.value_rows(small, owners) == [("enc/conv", 1.0)]
    assert explain.value_category(small, owners, backward_start=3) == explain.GATHERED
    # A value of the layer loop outside its body with the layers' leading dimension: split over them.
    stacked = dataclasses.replace(big, dims=(2, 8))
    assert explain.value_rows(stacked, owners) == [("layers.0", 0.5), ("layers.1", 0.5)]
    assert explain.value_rows(big, owners) == [("layers" + explain.ONE_AT_A_TIME, 1.0)]
    assert explain.value_category(big, owners, backward_start=2) == explain.OTHER  # dead before the backward
    assert explain.value_category(dataclasses.replace(big, end=3), owners, backward_start=2) == explain.SAVED


GPT_TINY = GPTConfig(vocab_size=256, num_layers=3, d_model=32, num_heads=2, max_len=16)


def _gpt_report(stage, **changes):
    # persistence_threshold 0: every leaf is partitioned (all their dimensions divide by 8).
    settings = dict(zero_stage=stage, micro_batch_size=2, persistence_threshold=0, remat="dots",
                    mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
    config = zeroflax.Config(**{**settings, **changes})
    engine, state, batch = abstract_gpt_engine(GPT_TINY, config, optax.adamw(1e-3), 16)
    return engine, zeroflax.memory_report(engine, state, batch, by="layer")


@pytest.fixture(scope="module")
def gpt_reports():
    return {stage: _gpt_report(stage) for stage in (0, 1, 3)}


def test_gpt_layers_sum_to_memory_analysis(gpt_reports):
    for stage, (engine, report) in gpt_reports.items():
        assert report.coverage >= 0.95, (stage, report.coverage, str(report))
        assert report.charged <= report.total
        # The arguments are charged leaf by leaf from the shardings: exactly what XLA counts.
        assert report.arguments == report.arguments_xla
        assert report.rows[:3] == ["layers.0", "layers.1", "layers.2"]
        assert report.peak_live <= report.total
        assert report.by_category()[explain.SAVED] > 0  # remat 'dots' keeps the matmuls' outputs
        json.dumps(report.to_dict())
        assert "memory_analysis total" in str(report)


def test_gpt_stages_partition_what_zero_says(gpt_reports):
    layer = lambda stage, cat: gpt_reports[stage][1].bytes["layers.0"].get((cat, explain.DEVICE), 0)
    # Adam's moments: 1/8 from stage 1 on; the parameters: 1/8 at stage 3 (every layer leaf divides by 8).
    assert layer(1, explain.OPT) == pytest.approx(layer(0, explain.OPT) / 8)
    assert layer(1, explain.PARAMS) == layer(0, explain.PARAMS)
    assert layer(3, explain.PARAMS) == pytest.approx(layer(0, explain.PARAMS) / 8)
    assert gpt_reports[3][1].total < gpt_reports[1][1].total < gpt_reports[0][1].total
    # Only stage 3 gathers weights, inside the layer loop.
    assert gpt_reports[0][1].by_category()[explain.GATHERED] == 0
    loop = gpt_reports[3][1].bytes["layers" + explain.ONE_AT_A_TIME]
    assert loop.get((explain.GATHERED, explain.DEVICE), 0) > 0


def test_unet_modules_sum_to_memory_analysis():
    model = UNet3D(UNet3DConfig(channels=(4, 8), groups=2))
    sample = {"image": jax.ShapeDtypeStruct((1, 8, 8, 8, 1), jnp.float32),
              "labels": jax.ShapeDtypeStruct((1, 8, 8, 8), jnp.int32)}
    totals = {}
    for stage in (0, 3):
        config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=16,
                                 mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
        engine, state = zeroflax.initialize(segmentation_loss(model), lambda rng, b: model.init(rng, b["image"])["params"],
                                            optax.adam(1e-3), config, sample_batch=sample, abstract=True)
        batch = {k: jax.ShapeDtypeStruct((8,) + v.shape[1:], v.dtype) for k, v in sample.items()}
        report = zeroflax.memory_report(engine, state, batch, by="layer")
        assert report.coverage >= 0.95, (stage, str(report))
        # The rows are the gather groups (module paths), which hold the parameters.
        groups = set(engine.probe_usage.groups)
        param_rows = {row for row, cells in report.bytes.items() if cells.get((explain.PARAMS, explain.DEVICE))}
        assert param_rows and param_rows <= groups, (param_rows, groups)
        totals[stage] = report.total
    assert totals[3] < totals[0]


def test_memory_report_refuses_an_unknown_grouping(gpt_reports):
    engine, _ = gpt_reports[0]
    with pytest.raises(ValueError, match="'category' or 'layer'"):
        zeroflax.memory_report(engine, engine.abstract_state(), None, by="module")


def test_explain_command_writes_table_figure_and_json(tmp_path):
    png, out = tmp_path / "layers.png", tmp_path / "layers.json"
    result = run_cli("explain", "--gin_file", f"{ROOT}/experiments/gpt_tiny_zero3.gin",
                     "--gin_param", "GPTConfig.num_layers = 2", "--gin_param", "GPTConfig.d_model = 32",
                     "--gin_param", "GPTConfig.max_len = 16", "--gin_param", "TrainConfig.seq_len = 16",
                     "--gin_param", "Config.micro_batch_size = 1", "--stages", "0,3",
                     "--png", str(png), "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZeRO stage 0" in result.stdout and "ZeRO stage 3" in result.stdout and "layers.1" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reports = json.loads(out.read_text())
    assert [r["stage"] for r in reports] == [0, 3] and all(r["coverage"] >= 0.95 for r in reports)
    bad = run_cli("explain", "--stages", "4")
    assert bad.returncode != 0 and "--stages" in bad.stderr
    # A stage the configuration refuses (1-bit Adam at stage 3) is reported, and the others still run.
    onebit = run_cli("explain", "--gin_file", f"{ROOT}/experiments/gpt_tiny_onebit.gin",
                     "--gin_param", "GPTConfig.num_layers = 2", "--gin_param", "GPTConfig.d_model = 32",
                     "--gin_param", "GPTConfig.max_len = 16", "--gin_param", "TrainConfig.seq_len = 16",
                     "--gin_param", "Config.micro_batch_size = 1", "--stages", "1,3", timeout=300)
    assert onebit.returncode == 0, onebit.stderr[-3000:]
    assert "ZeRO stage 3: refused" in onebit.stdout and "ZeRO stage 1, N=8" in onebit.stdout


def test_step_timeline_shows_zero_inside_the_all_reduce():
    from models import MLP, linen_case

    init, loss, make = linen_case(MLP(hidden=64, out=8), (16,), 8)
    batch = make(np.random.default_rng(0), 16)
    timelines = {}
    for stage in (0, 2, 3):
        config = zeroflax.Config(zero_stage=stage, micro_batch_size=2, persistence_threshold=0,
                                 mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
        engine, state = zeroflax.initialize(loss, init, optax.adam(1e-3), config, sample_batch=batch, abstract=True)
        timelines[stage] = explain.step_timeline(engine, state, batch)
    moved = lambda stage, phase: sum(t.bytes for t in timelines[stage] if t.phase == phase)
    # Stage 0: the gradients' all-reduce, nothing else. Stage 2: its two halves, the update between them.
    assert {t.phase for t in timelines[0]} == {"gradient sync (all-reduce)"}
    scatter, gather = moved(2, "gradient sync (reduce-scatter)"), moved(2, "all-gather of the updated parameters")
    assert scatter == pytest.approx(gather) and scatter > 0
    assert moved(0, "gradient sync (all-reduce)") == pytest.approx(scatter + gather, abs=64)  # + the loss
    # Stage 3: every layer gathered for the forward pass, its gradient reduce-scattered in the backward.
    layers = {"Dense_0", "Dense_1", "Dense_2"}
    assert {t.row for t in timelines[3] if t.phase == "forward gather"} == layers
    assert {t.row for t in timelines[3] if t.phase == "backward reduce-scatter"} == layers
    order = [t.moment for t in timelines[3]]
    assert order == sorted(order) and min(order) >= 0
    last_forward = max(t.moment for t in timelines[3] if t.phase == "forward gather")
    assert all(t.moment > last_forward for t in timelines[3] if t.phase.startswith("backward"))
    assert "forward gather" in explain.format_timeline(timelines[3])

"""`zeroflax estimate`: DeepSpeed's estimator formulas equal DeepSpeed's own functions (test vectors from
tools/gen_deepspeed_estimates.py), and zeroflax's own figures meet compiled.memory_analysis() of the real
engine for the tiny GPT at stages 0-3, with offload and with NVMe offload on 8 simulated devices."""
import json
import pathlib

import numpy as np
import optax
import pytest

import zeroflax
from zeroflax import cli, estimate
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss

DATA = pathlib.Path(__file__).parent / "data" / "deepspeed_estimates.json"


def _cases():
    data = json.loads(DATA.read_text())
    for key in ("zero2", "zero3"):
        table = data[key]
        names, width = table["arguments"], len(table["arguments"])
        for row in table["rows"]:
            yield key, row[0], dict(zip(names[1:], row[1:width])), row[width:]


CASES = list(_cases())


def test_deepspeed_formulas_equal_deepspeeds_functions():
    """Every case of the generated grid: the same integers DeepSpeed's functions returned."""
    functions = {"zero2": estimate.deepspeed_zero2, "zero3": estimate.deepspeed_zero3}
    for key, model, kwargs, expected in CASES:
        assert list(functions[key](**kwargs)) == expected, (key, model, kwargs)


def test_the_grid_covers_three_model_sizes_and_every_offload_flag():
    """The equality above means something only if the grid is what the generator promises."""
    meta = json.loads(DATA.read_text())["meta"]
    assert meta["source"].startswith("deepspeedai/DeepSpeed@") and len(meta["source"].split("@")[1]) == 40
    sizes = {kwargs["total_params"] for _, _, kwargs, _ in CASES}
    assert len([s for s in sizes if s >= 10**8]) >= 3
    zero3_flags = {(k["cpu_offload"], k["cpu_offload_params"], k["zero_init"]) for key, _, k, _ in CASES if key == "zero3"}
    assert len(zero3_flags) == 8
    assert {k["cpu_offload"] for key, _, k, _ in CASES if key == "zero2"} == {False, True}
    assert len({(k["num_gpus_per_node"], k["num_nodes"]) for _, _, k, _ in CASES}) >= 6


# ------------------------------------------------------------------ zeroflax's figures vs memory_analysis
GPT_TINY = GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=32)
SEQ, MICRO = 32, 2
# (stage, offload, remat, grad_accum_steps): every stage, both offloads, NVMe (beside the same row with the
# state in host memory), three remat policies, accumulation.
ROWS = [(0, "none", "none", 1), (1, "none", "full", 2), (2, "none", "dots", 2), (3, "none", "dots", 1),
        (2, "optimizer", "full", 1), (3, "optimizer+param", "dots_no_batch", 2), (2, "nvme", "full", 1)]


def _compiled_memory(stage, offload, remat, accum, nvme_path):
    model = GPT(GPT_TINY)
    optimizer = (zeroflax.OffloadOptimizerConfig("nvme", nvme_path=str(nvme_path)) if offload == "nvme" else
                 zeroflax.OffloadOptimizerConfig("cpu" if offload != "none" else "none"))
    config = zeroflax.Config(
        zero_stage=stage, remat=remat, micro_batch_size=MICRO, grad_accum_steps=accum, persistence_threshold=256,
        grad_clip=1.0, offload_optimizer=optimizer,
        offload_param=zeroflax.OffloadParamConfig("cpu" if offload == "optimizer+param" else "none"))
    batch = {"tokens": np.zeros((config.resolve_train_batch(8), SEQ + 1), np.int32)}
    engine, state = zeroflax.initialize(next_token_loss(model), lambda r, b: model.init(r, b["tokens"][:, :-1])["params"],
                                        optax.adamw(1e-3), config, sample_batch=batch, abstract=True)
    stats = engine.compile(state, batch).memory_analysis()
    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
    return stats.argument_size_in_bytes, peak


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("estimate") / "nvme"
    out = {row: _compiled_memory(*row, nvme) for row in ROWS}
    assert not nvme.exists()  # abstract: the NVMe engine compiled without creating its file
    return out


def _estimated(stage, offload, remat, accum):
    spec = estimate.spec_from_gpt(GPT_TINY, optax.adamw(1e-3))
    setup = estimate.Setup({"data": 8, "tensor": 1}, 8, "fp32", 256)
    result = estimate.estimate(spec, setup, train=dict(micro_batch=MICRO, accum=accum, seq=SEQ, remat=remat))
    return next(r for r in result["rows"] if (r["stage"], r["offload"]) == (stage, offload))


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(map(str, r)))
def test_arguments_equal_memory_analysis(measured, row):
    """At rest: the step's arguments (device and host states + this device's batch rows; XLA:CPU counts host
    memory as the device's) from the placement formulas. The acceptance is 10%; the formulas follow the
    placement leaf by leaf, so the only difference left would be a state the estimate forgot, and 0.1%
    (about 600 bytes here) is below any parameter leaf of this model."""
    arguments, _ = measured[row]
    estimated = _estimated(*row)["arguments"]
    assert abs(estimated / arguments - 1) < 1e-3, (row, estimated, arguments)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: "-".join(map(str, r)))
def test_peak_model_is_within_its_stated_error(measured, row):
    """The peak (arguments + gradients + saved activations + the recomputed layer) against memory_analysis'
    argument + output + temp - alias. Its error is -10% to +16% on the main job's GPT at 49 configurations
    and -7% to +28% on these six (docs/plan.md): not the 10% the arguments meet. `zeroflax plan` prunes on
    it only beyond PEAK_MARGIN (+40%), so the test holds it below the margin (and above -20%): a model that
    drifts out of that band breaks the plan's pruning rule."""
    from zeroflax.plan import PEAK_MARGIN
    _, peak = measured[row]
    modeled = _estimated(*row)["peak_with_host"]
    error = modeled / peak - 1
    print(f"{row}: modeled {modeled:.0f}, memory_analysis {peak}, error {error:+.3f}")
    assert -0.2 < error < PEAK_MARGIN, (row, modeled, peak)


def test_cli_prints_both_columns_and_json(capsys):
    assert cli.main(["estimate", "--params", "1.3e9", "--largest_layer_params", "1.03e8", "--devices", "8",
                     "--nodes", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["stage"], r["offload"]): r for r in result["rows"]}
    cpu, gpu, _ = estimate.deepspeed_zero3(1_300_000_000, 103_000_000, 8, 2, True, True, True, 1.5)
    assert (rows[3, "optimizer+param"]["deepspeed_gpu"], rows[3, "optimizer+param"]["deepspeed_cpu_per_node"]) == (gpu, cpu)
    assert rows[0, "none"]["deepspeed_gpu"] is None  # DeepSpeed publishes no stage 0/1 estimator
    # docs/design.md section 2 at rest, N = 16: 12 Psi, 4 Psi + 8 Psi / N, 12 Psi / N; host 12 Psi / N per device
    # (plus 28 bytes of step, rng and loss scale).
    psi = 1_300_000_000
    assert rows[0, "none"]["device_at_rest"] == pytest.approx(12 * psi, abs=64)
    assert rows[2, "none"]["device_at_rest"] == pytest.approx(4 * psi + 8 * psi / 16, abs=64)
    assert rows[3, "none"]["device_at_rest"] == pytest.approx(12 * psi / 16, abs=64)
    assert rows[3, "optimizer"]["host_per_node"] == pytest.approx(8 * 12 * psi / 16, abs=64)
    assert cli.main(["estimate", "--params", "125e6", "--devices", "4"]) == 0
    table = capsys.readouterr().out
    assert "DeepSpeed" in table and "optimizer+param" in table


def test_nvme_rows_put_the_optimizer_state_on_disk(capsys):
    """A bare count (every leaf partitioned), Adam, N = 16: each 'nvme' row holds 12 Psi / N on disk per device
    (x 8 per node) and nothing in host memory but the stream's buffers; the device keeps the 'optimizer' row's
    compute copy plus the reduced fp32 gradient shard (4 Psi / N); DeepSpeed has no NVMe figures."""
    psi, n = 1_300_000_000, 16
    assert cli.main(["estimate", "--params", "1.3e9", "--devices", "8", "--nodes", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {(r["stage"], r["offload"]): r for r in result["rows"]}
    assert [s for s, o in rows if o == "nvme"] == [1, 2, 3]
    for stage in (1, 2, 3):
        nvme, host = rows[stage, "nvme"], rows[stage, "optimizer"]
        assert nvme["disk_per_device"] == pytest.approx(12 * psi / n, rel=1e-12)
        assert nvme["disk_per_node"] == pytest.approx(8 * 12 * psi / n, rel=1e-12)
        assert nvme["disk_per_device"] == pytest.approx(host["host_per_device"], rel=1e-12)
        assert nvme["host_per_device"] == nvme["host_per_node"] == 0
        assert nvme["deepspeed_gpu"] is None and nvme["deepspeed_cpu_per_node"] is None
        assert nvme["compute_copy"] == host["compute_copy"]
        assert nvme["pending_grads"] == pytest.approx(4 * psi / n, rel=1e-12)
        assert nvme["device_at_rest"] == pytest.approx(host["device_at_rest"] + 4 * psi / n, abs=1)
        # Defaults: 4 buffers of 10M elements (the shards are 81M) at 12 bytes.
        assert nvme["host_buffers"] == 4 * 10_000_000 * 12
        assert host["disk_per_device"] == 0 and host["host_buffers"] == 0
    assert "deepspeed_gpu" in result["sources"] and "NVMe" in result["sources"]["deepspeed_gpu"]
    assert cli.main(["estimate", "--params", "1.3e9", "--devices", "8", "--nodes", "2", "--unit", "GiB"]) == 0
    table = capsys.readouterr().out
    section = table.split("NVMe (offload_optimizer nvme)")[1]  # the disk table below the main one
    line = next(l for l in section.splitlines() if l.startswith("3      nvme"))
    disk = 12 * psi / n / 2**30
    assert f"{disk:10.2f} {8 * disk:10.2f}" in line, line


def test_cli_errors_name_the_flag(capsys):
    assert cli.main(["estimate", "--params", "1.5"]) == 2
    assert "--params" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1e6", "--gin_param", "Config.zero_stage = 1"]) == 2
    assert "--params" in capsys.readouterr().err
    assert cli.main(["estimate", "--params", "1e6", "--devices", "0"]) == 2
    assert "--devices" in capsys.readouterr().err

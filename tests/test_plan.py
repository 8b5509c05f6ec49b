"""`zeroflax plan`: on 8 simulated devices, with a per-device budget that every stage-0 configuration of the
tiny GPT exceeds, the chosen configuration compiles within the budget, no candidate the cost model
predicts cheaper was let go except by a compile over budget or a memory rule, the analytic bounds are
below the compiled costs, and the written gin file trains. NVMe offload ('nvme') is searched only on
request, with a directory, pruned by --disk-memory, and compiled from abstract inputs without a file."""
import json
import math
import os

import gin
import pytest

from cli_helpers import TINY, losses, tiny_bindings, zeroflax as run_cli
from zeroflax import cli
from zeroflax.config import Config
from zeroflax.models.gpt import GPTConfig
from zeroflax.plan import Candidate, Planner, Space, enumerate_candidates
from zeroflax.train import TrainConfig

# The tiny GPT at 2 sequences of 32 tokens per device: every stage-0 step needs more than 850 KiB
# (its arguments alone are 404 KiB, 12 bytes per parameter), a stage-1 step with remat 'dots' and 2
# accumulation steps about 630 KiB: 700 KB (684 KiB) lies between. The test checks that premise itself.
BUDGET = "700KB"
# A reduced space, so that the search compiles a handful of steps: every stage, offload of the optimizer,
# three remat policies, both micro-batchings of 2 sequences per device; no tensor or pipe axis.
SPACE = ["--stages", "0,1,2,3", "--offload", "none,optimizer", "--remat", "none,dots,full", "--tensor", "1"]


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    out, report = tmp / "plan.gin", tmp / "plan.json"
    env = os.environ.get("XLA_FLAGS")
    args = ["plan", "--gin_file", TINY, *tiny_bindings(tmp / "run"), "--gin_param", "Config.micro_batch_size = 2",
            "--device-memory", BUDGET, *SPACE, "--tie", "0", "--out", str(out), "--json", str(report), "--no_progress"]
    try:
        assert cli.main(args) == 0
    finally:
        gin.clear_config()
        os.environ["XLA_FLAGS"] = env  # cmd_plan sets the simulated device count for a fresh process
    return out, json.loads(report.read_text())


def test_winner_fits_and_every_cheaper_candidate_was_rejected_safely(planned):
    _, result = planned
    budget, winner = result["budget"], result["winner"]
    candidates = [c for c in result["candidates"] if c["status"] != "invalid"]
    # Only what the Config refuses is invalid (stage 3 without remat, offload at stage 0), whatever the
    # input gin's own stage (3 here) would refuse: a candidate is checked as a whole.
    for c in result["candidates"]:
        if c["status"] == "invalid":
            assert (c["stage"], c["remat"]) == (3, "none") or (c["stage"], c["offload"] != "none") == (0, True), c
    assert any(c["remat"] == "none" for c in candidates)
    assert winner is not None and winner["status"] == "fits" and winner["measured"] is not None
    assert winner["device_peak"] <= budget
    # The premise: the job itself at stage 0 (the gin file's remat 'dots', 2 sequences in one micro-batch)
    # exceeds the budget, and so does every stage-0 candidate that was compiled.
    job0 = next(c for c in candidates if (c["stage"], c["offload"], c["remat"], c["micro_batch"]) == (0, "none", "dots", 2))
    assert job0["status"] == "over budget" or job0["reason"].startswith("memory:"), job0
    assert all(c["device_peak"] > budget for c in candidates if c["stage"] == 0 and c["measured"] is not None)
    cost = winner["predicted_s"]
    for c in candidates:
        if c["predicted_s"] < cost:  # --tie 0: strictly cheaper by the cost model
            assert c["status"] == "over budget" or (c["status"] == "pruned" and c["reason"].startswith("memory:")), c
        if c["status"] == "fits":
            assert c["predicted_s"] >= cost
        if c["reason"].startswith("cost:"):  # stopped: its lower bound is not below the winner's cost
            assert c["bound"] is not None and c["predicted_s"] >= cost
    assert all(c["status"] != "pending" for c in result["candidates"])


def test_bounds_are_below_the_compiled_costs(planned):
    """The stopping rule is only safe if the analytic cost never exceeds what the compiled program costs."""
    _, result = planned
    compiled = [c for c in result["candidates"] if c["measured"] is not None]
    assert len(compiled) >= 2
    for c in compiled:
        for term in ("comm", "host", "flops"):
            assert c["bound"][term] <= c["measured"][term] * (1 + 1e-9), (c["label"], term)


def test_the_stage3_bound_holds_where_xla_gathers_less_than_each_pass():
    """Beyond the search's candidates: at stage 3 XLA skips the backward gather of a bias or scale the
    recomputation does not need, and (the main job at 4 micro-batches) gathers a kept embedding once per step;
    the bound once counted both per pass and exceeded the compiled bytes."""
    base = Config(micro_batch_size=2, persistence_threshold=0, grad_clip=1.0, remat="dots")
    planner = Planner(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=32), base,
                      TrainConfig(seq_len=32, steps=6, warmup_steps=1), 8)
    for accum in (1, 4):
        candidate = Candidate(1, 1, 8, 3, "none", "dots", 1, accum)
        planner.analyse(candidate, 8 * accum)
        planner.compile(candidate, 8 * accum)
        assert candidate.bound.comm <= candidate.measured.comm, (accum, candidate.bound.comm, candidate.measured.comm)


def test_a_memory_pruned_candidate_would_not_have_fit(planned):
    """The cheapest candidate the modeled peak pruned, compiled after all: it is over the budget."""
    _, result = planned
    pruned = [c for c in result["candidates"] if c["reason"].startswith("memory: modeled peak")]
    assert pruned
    c = min(pruned, key=lambda c: c["predicted_s"])
    base = Config(micro_batch_size=2, persistence_threshold=0, grad_clip=1.0, remat="dots")
    planner = Planner(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=32), base,
                      TrainConfig(seq_len=32, steps=6, warmup_steps=1), 8)
    candidate = Candidate(c["pipe"], c["tensor"], c["data"], c["stage"], c["offload"], c["remat"], c["micro_batch"],
                          c["accum"])
    planner.analyse(candidate, result["global_batch"])
    planner.compile(candidate, result["global_batch"])
    assert candidate.device_peak > result["budget"], (c["label"], candidate.device_peak)


def test_the_written_gin_file_trains(planned, tmp_path):
    out, result = planned
    text = out.read_text()
    winner = result["winner"]
    assert f"Config.zero_stage = {winner['stage']}" in text and f"Config.remat = '{winner['remat']}'" in text
    workdir = tmp_path / "trained"
    run = run_cli("train", "--gin_file", str(out), "--gin_param", "TrainConfig.steps = 2",
                  "--gin_param", f"TrainConfig.workdir = '{workdir}'", "--no_progress")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"ZeRO stage {winner['stage']}" in run.stdout
    trained = losses(workdir)
    assert sorted(trained) == [1, 2] and all(math.isfinite(v) for v in trained.values())


def test_errors_name_the_flag(capsys):
    env = os.environ.get("XLA_FLAGS")
    try:
        assert cli.main(["plan", "--device-memory", "lots"]) == 2
        assert "--device-memory" in capsys.readouterr().err
        assert cli.main(["plan", "--device-memory", "1GB", "--remat", "most"]) == 2
        assert "--remat" in capsys.readouterr().err
        assert cli.main(["plan", "--device-memory", "1GB", "--offload", "none,disk"]) == 2
        assert "--offload" in (err := capsys.readouterr().err) and "nvme" in err
        assert cli.main(["plan", "--device-memory", "1GB", "--offload", "nvme", "--nvme-path", "/x",
                         "--disk-memory", "much"]) == 2
        assert "--disk-memory" in capsys.readouterr().err
        # These two fail after the gin config is parsed (and locked): cleared between them.
        assert cli.main(["plan", "--device-memory", "1GB", "--offload", "none,nvme"]) == 2
        assert "--nvme-path" in capsys.readouterr().err
        gin.clear_config()
        assert cli.main(["plan", "--device-memory", "1GB", "--devices", "4"]) == 2
        assert "--devices" in capsys.readouterr().err
    finally:
        gin.clear_config()
        os.environ["XLA_FLAGS"] = env


# ------------------------------------------------------------------------------------------ NVMe offload
GPT_TINY = GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=32)


def test_nvme_candidates_only_on_request():
    """Not in the default space (it needs a directory); asked for, at stages 1-3 only, each with the path."""
    base = Config(micro_batch_size=2, persistence_threshold=0)
    default = enumerate_candidates(base, GPT_TINY, 8, 16, Space(remats=("full",), tensor=(1,)))
    assert default and all(c.offload != "nvme" for c in default)
    asked = enumerate_candidates(base, GPT_TINY, 8, 16, Space(offloads=("none", "nvme"), remats=("full",),
                                                               tensor=(1,), nvme_path="/local_nvme/run"))
    nvme = [c for c in asked if c.offload == "nvme"]
    assert sorted({c.stage for c in nvme}) == [1, 2, 3]
    assert all(c.nvme_path == "/local_nvme/run" for c in nvme)
    config = nvme[0].config(base).offload_optimizer
    assert (config.device, config.nvme_path) == ("nvme", "/local_nvme/run")


def _plan(tmp, *args):
    """`zeroflax plan` of the tiny GPT at 2 sequences per device in one micro-batch, 'full' remat, data 8; its
    JSON report (written whether or not a candidate fits) and exit code."""
    report = tmp / "plan.json"
    env = os.environ.get("XLA_FLAGS")
    try:
        code = cli.main(["plan", "--gin_file", TINY, *tiny_bindings(tmp / "run"), "--gin_param",
                         "Config.micro_batch_size = 2", "--remat", "full", "--micro-batches", "2", "--tensor", "1",
                         "--json", str(report), "--no_progress", *args])
    finally:
        gin.clear_config()
        os.environ["XLA_FLAGS"] = env
    return code, json.loads(report.read_text())


def test_disk_memory_prunes_nvme_candidates(tmp_path):
    """Every 'nvme' candidate holds 12 bytes per parameter / 8 on disk per device, 12 x 34,432 = 413 KB over
    the 8 devices: a 400 KB disk prunes each one by that rule, before any compile."""
    code, result = _plan(tmp_path, "--device-memory", "1MB", "--stages", "1,2,3", "--offload", "nvme",
                         "--nvme-path", str(tmp_path / "nvme"), "--disk-memory", "400KB")
    assert code == 2 and result["compiles"] == 0 and result["disk_budget"] == 400e3
    assert len(result["candidates"]) == 3
    for c in result["candidates"]:
        assert c["status"] == "pruned" and c["reason"].startswith("memory: disk states ")
        # (and the optimizer's step counts, kept beside the records: a few bytes)
        assert "> --disk-memory" in c["reason"] and c["disk"] == pytest.approx(12 * 34_432 / 8, abs=16)


def test_a_plan_with_nvme_compiles_without_a_file(tmp_path):
    """--offload none,nvme at stage 3, with a budget between the two compiled peaks (none 413 KiB, nvme 383
    KiB: the compute copy takes the master weights' place and the Adam state is on disk): the 'none'
    candidate is cheaper by the bound, compiles over the budget, and the 'nvme' one wins. Its disk and
    host bytes (after the program) are the bound's; the winner's gin file names the path, where nothing
    was written."""
    nvme, out = tmp_path / "nvme", tmp_path / "plan.gin"
    code, result = _plan(tmp_path, "--device-memory", "398KiB", "--stages", "3", "--offload", "none,nvme",
                         "--nvme-path", str(nvme), "--out", str(out))
    assert code == 0 and not nvme.exists()
    by = {c["offload"]: c for c in result["candidates"]}
    assert by["none"]["status"] == "over budget", by["none"]
    winner = result["winner"]
    assert winner["offload"] == "nvme" and winner["device_peak"] <= result["budget"]
    assert winner["measured"]["disk"] == pytest.approx(winner["bound"]["disk"], rel=1e-9)
    assert winner["measured"]["disk"] == pytest.approx(2 * 12 * 34_432 / 8, rel=1e-9)  # read + written
    assert winner["bound"]["host"] <= winner["measured"]["host"] * (1 + 1e-9)
    assert winner["bound"]["flops"] <= winner["measured"]["flops"] * (1 + 1e-9)
    # The gin file binds a Config the engine takes (without training it: that would write the file).
    from zeroflax.command_flags import parse_gin
    try:
        parse_gin([str(out)], [])
        offload = Config().offload_optimizer
    finally:
        gin.clear_config()
    assert (offload.device, offload.nvme_path, offload.buffer_count) == ("nvme", str(nvme), 4)

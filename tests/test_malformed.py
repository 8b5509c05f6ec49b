"""The malformed-input corpus: every bad gin file, flag, data file and checkpoint gives exit status 2 and one
line `zeroflax: error: ...` naming the file or key, and leaves an existing run directory as it was.

Environments (the variables of a multi-process job) are set per case.
Gin files are in tests/malformed/ (each is given after the tiny main job's gin file, so it overrides it);
data files and damaged checkpoints are made here. The command runs in this process (`zeroflax.cli.main`),
which keeps 60 cases to seconds: none of them gets as far as compiling a step.
"""
import hashlib
import os
import shutil
import socket

import gin
import numpy as np
import pytest

from cli_helpers import ROOT, TINY, tiny_bindings
from zeroflax.cli import main

MALFORMED = os.path.join(ROOT, "tests", "malformed")


def _gin(name):
    return os.path.join(MALFORMED, name)


# (id, arguments after `zeroflax`, text the one error line must contain). {run}: a copy of a finished run
# (damaged per case, see DAMAGE); {data}: the directory of made data files; {tmp}: a fresh directory.
GIN_CASES = [
    ("syntax_unclosed.gin", "--gin_file: gin:"),
    ("syntax_bad_selector.gin", "Malformatted scope or selector"),
    ("syntax_missing_equals.gin", "--gin_file: gin:"),
    ("unknown_configurable.gin", "NoSuchThing"),
    ("unknown_parameter.gin", "zero_stag"),
    ("wrong_type_stage.gin", "Config.zero_stage"),
    ("stage_out_of_range.gin", "Config.zero_stage: must be 0, 1, 2 or 3, got 5"),
    ("unknown_precision.gin", "Config.precision"),
    ("negative_micro_batch.gin", "Config.micro_batch_size"),
    ("unknown_remat.gin", "Config.remat"),
    ("unknown_nonfinite.gin", "Config.nonfinite"),
    ("import_statement.gin", "import os: gin import statements are refused"),
    ("include_missing.gin", "no_such_file.gin"),
    ("negative_learning_rate.gin", "TrainConfig.learning_rate"),
    ("unknown_optimizer.gin", "TrainConfig.optimizer"),
    ("zero_steps.gin", "TrainConfig.steps"),
    ("val_fraction_too_big.gin", "TrainConfig.val_fraction"),
    ("heads_do_not_divide.gin", "GPTConfig.num_heads"),
    ("unknown_attention.gin", "GPTConfig.attention"),
    ("max_len_below_seq_len.gin", "GPTConfig.max_len"),
    ("vocab_below_data.gin", "GPTConfig.vocab_size"),
    ("offload_param_below_stage3.gin", "OffloadParamConfig.device"),
    ("mesh_larger_than_devices.gin", "MeshConfig.axes"),
    ("tensor_does_not_divide.gin", "MeshConfig.axes"),
    ("train_batch_mismatch.gin", "Config.train_batch_size"),
    ("negative_grad_clip.gin", "Config.grad_clip"),
    ("data_missing.gin", "no_such_corpus.txt"),
]

FLAG_CASES = [
    ("no_subcommand", [], "zeroflax: the following arguments are required"),
    ("unknown_subcommand", ["nosuch"], "invalid choice: 'nosuch'"),
    ("unknown_flag", ["train", "--gin_file", TINY, "--no_such_flag"], "unrecognized arguments: --no_such_flag"),
    ("missing_gin_file", ["train", "--gin_file", "{tmp}/missing.gin"], "--gin_file: {tmp}/missing.gin does not exist"),
    ("stop_at_not_a_number", ["train", "--gin_file", TINY, "--stop_at", "x"], "--stop_at: invalid int value"),
    ("resume_and_overwrite", ["train", "--gin_file", TINY, "--resume", "--overwrite"], "--overwrite: contradicts --resume"),
    ("binding_unknown", ["train", "--gin_file", TINY, "--gin_param", "Config.zero_stag = 2"], "zero_stag"),
    ("binding_import", ["train", "--gin_file", TINY, "--gin_param", "import os"], "gin import statements are refused"),
    ("binding_unclosed", ["train", "--gin_file", TINY, "--gin_param", "Config.zero_stage = ("], "--gin_param: gin:"),
    ("deepspeed_config_missing", ["train", "--gin_file", TINY, "--deepspeed_config", "{tmp}/ds.json"], "ds.json"),
    ("generate_missing_checkpoint", ["generate", "--checkpoint", "{tmp}/nowhere"], "{tmp}/nowhere"),
    ("export_bad_format", ["export", "--checkpoint", "{run}", "--format", "onnx"], "--format: unknown format 'onnx'"),
    ("export_missing_checkpoint", ["export", "--checkpoint", "{tmp}/nowhere"], "{tmp}/nowhere"),
    ("export_bad_dtype", ["export", "--checkpoint", "{run}", "--dtype", "fp8"], "--dtype"),
    ("explain_bad_stage", ["explain", "--stages", "9"], "--stages"),
    ("explain_bad_devices", ["explain", "--devices", "0"], "--devices"),
    ("plan_bad_memory", ["plan", "--device-memory", "lots"], "--device-memory"),
    ("estimate_bad_flag", ["estimate", "--no_such"], "unrecognized arguments: --no_such"),
    ("launch_without_command", ["launch", "--nproc", "2"], "zeroflax launch: give the command after --"),
    ("train_no_cpu_devices", ["train", "--gin_file", TINY, "--cpu_devices", "0"], "--cpu_devices: must be at least 1"),
]

# Environments: (id, variables for `zeroflax train --resume` of a copy of a finished run, text of the error line).
# {silent}: a local port nobody listens on; {held}: one this test listens on. ZEROFLAX_INIT_TIMEOUT bounds the wait.
_JOB = {"ZEROFLAX_NUM_PROCESSES": "2", "ZEROFLAX_PROCESS_ID": "1", "ZEROFLAX_INIT_TIMEOUT": "1"}
ENV_CASES = [
    ("coordinator_silent", {**_JOB, "ZEROFLAX_COORDINATOR": "127.0.0.1:{silent}"},
     "ZEROFLAX_COORDINATOR: the coordinator at 127.0.0.1:{silent} (process 0) did not answer within 1 s"),
    ("coordinator_port_in_use", {**_JOB, "ZEROFLAX_PROCESS_ID": "0", "ZEROFLAX_COORDINATOR": "127.0.0.1:{held}"},
     "ZEROFLAX_COORDINATOR: process 0 cannot listen on 127.0.0.1:{held}"),
    ("coordinator_not_host_port", {**_JOB, "ZEROFLAX_COORDINATOR": "localhost"}, "'localhost' is not host:port"),
    ("process_id_out_of_range", {**_JOB, "ZEROFLAX_PROCESS_ID": "2", "ZEROFLAX_COORDINATOR": "127.0.0.1:{silent}"},
     "ZEROFLAX_PROCESS_ID: 2 is not below ZEROFLAX_NUM_PROCESSES = 2"),
    ("num_processes_not_a_number", {**_JOB, "ZEROFLAX_NUM_PROCESSES": "two", "ZEROFLAX_COORDINATOR": "127.0.0.1:{silent}"},
     "ZEROFLAX_NUM_PROCESSES: must be an integer >= 1, got 'two'"),
    ("heartbeat_zero", {**_JOB, "ZEROFLAX_HEARTBEAT_TIMEOUT": "0", "ZEROFLAX_COORDINATOR": "127.0.0.1:{silent}"},
     "ZEROFLAX_HEARTBEAT_TIMEOUT: must be an integer >= 1, got '0'"),
    ("init_timeout_negative", {**_JOB, "ZEROFLAX_INIT_TIMEOUT": "-5", "ZEROFLAX_COORDINATOR": "127.0.0.1:{silent}"},
     "ZEROFLAX_INIT_TIMEOUT: must be an integer >= 1, got '-5'"),
    ("cpu_devices_not_a_number", {"ZEROFLAX_CPU_DEVICES": "eight"}, "ZEROFLAX_CPU_DEVICES: must be an integer >= 1"),
]

# Data files, made by `data_dir`: (file name, writer); the case trains on it (TrainConfig.data).
DATA_CASES = [
    ("empty.txt", lambda p: open(p, "wb").close(), "is empty"),
    ("floats.npy", lambda p: np.save(p, np.linspace(0, 1, 500)), "expected an integer dtype"),
    ("rank2.npy", lambda p: np.save(p, np.zeros((10, 50), np.int32)), "expected 1-D"),
    ("short.npy", lambda p: np.save(p, np.arange(10, dtype=np.int32)), "short.npy': stream of 10 tokens is too short"),
    ("too_big_ids.npy", lambda p: np.save(p, np.full(5000, 300, np.int32)), "GPTConfig.vocab_size"),
    ("negative.npy", lambda p: np.save(p, np.full(5000, -1, np.int32)), "outside [0, 2**31 - 1]"),
    ("pickled.npy", lambda p: np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True), "pickled.npy"),
    ("truncated.npy", lambda p: open(p, "wb").write(b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fo"), "truncated.npy"),
    ("empty_array.npy", lambda p: np.save(p, np.zeros(0, np.int32)), "is empty"),
    ("a_directory", lambda p: os.makedirs(p), "a_directory"),
    ("archive.npy", lambda p: np.savez(open(p, "wb"), a=np.zeros(3)), "archive.npy"),
]


# Damage done to a copy of a finished run before resuming it, generating from it or exporting it.
def _truncate_arrays(run):
    """Halve every file of 4 KiB or more in the newest checkpoint: the array data, whichever part is read."""
    for d, _, files in os.walk(_newest(run)):
        for name in files:
            path = os.path.join(d, name)
            if os.path.getsize(path) >= 4096:
                with open(path, "r+b") as f:
                    f.truncate(os.path.getsize(path) // 2)


def _newest(run):
    return os.path.join(run, "checkpoints", str(max(int(d) for d in os.listdir(os.path.join(run, "checkpoints"))
                                                    if d.isdigit())))


def _remove_metadata(run):
    for d, _, fs in os.walk(_newest(run)):
        for f in fs:
            if "metadata" in f.lower():
                os.remove(os.path.join(d, f))


def _plant_pickle(run):
    import pickle
    for d, _, fs in os.walk(_newest(run)):
        for f in fs:
            if os.path.getsize(os.path.join(d, f)) < 4096:
                with open(os.path.join(d, f), "wb") as out:
                    out.write(pickle.dumps({"not": "a checkpoint"}))


def _tamper_step(run):
    newest = _newest(run)
    os.rename(newest, os.path.join(os.path.dirname(newest), "99"))


DAMAGE = {
    "truncated_array": _truncate_arrays,
    "missing_metadata": _remove_metadata,
    "planted_pickle": _plant_pickle,
    "tampered_step": _tamper_step,
    "emptied_checkpoints": lambda run: [shutil.rmtree(os.path.join(run, "checkpoints", d))
                                        for d in os.listdir(os.path.join(run, "checkpoints"))
                                        if d.isdigit()],
}
RESUME_ARGS = ["train", "--gin_file", TINY, "--resume", "--no_progress"]
CHECKPOINT_CASES = [
    ("resume_truncated_array", "truncated_array", RESUME_ARGS, "checkpoint"),
    ("resume_missing_metadata", "missing_metadata", RESUME_ARGS, "checkpoint"),
    ("resume_planted_pickle", "planted_pickle", RESUME_ARGS, "checkpoint"),
    ("resume_tampered_step", "tampered_step", RESUME_ARGS, "checkpoint"),
    ("resume_other_width", None, RESUME_ARGS + ["--gin_param", "GPTConfig.d_model = 64"], "checkpoint"),
    ("resume_other_vocabulary", None, RESUME_ARGS + ["--gin_param", "GPTConfig.vocab_size = 300"], "checkpoint"),
    ("resume_other_depth", None, RESUME_ARGS + ["--gin_param", "GPTConfig.num_layers = 3"], "checkpoint"),
    ("train_over_it", None, ["train", "--gin_file", TINY, "--no_progress"], "--resume"),
    ("generate_truncated_array", "truncated_array", ["generate", "--checkpoint", "{run}"], "checkpoint"),
    ("generate_planted_pickle", "planted_pickle", ["generate", "--checkpoint", "{run}"], "checkpoint"),
    ("export_truncated_array", "truncated_array", ["export", "--checkpoint", "{run}"], "checkpoint"),
    ("export_missing_metadata", "missing_metadata", ["export", "--checkpoint", "{run}"], "checkpoint"),
    ("generate_no_checkpoint", "emptied_checkpoints", ["generate", "--checkpoint", "{run}"], "checkpoint"),
    ("init_from_not_safetensors", None, RESUME_ARGS[:3] + ["--overwrite", "--gin_param",
                                                          "TrainConfig.init_from = '{data}/floats.npy'"], "floats.npy"),
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A tiny main-job run of 2 steps with a checkpoint at step 2."""
    run = str(tmp_path_factory.mktemp("finished") / "run")
    assert _main(["train", "--gin_file", TINY, *tiny_bindings(run, steps=2), "--no_progress"]) == 0
    return run


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("data")
    for name, write, _ in DATA_CASES:
        write(str(directory / name))
    np.save(directory / "floats.npy", np.linspace(0, 1, 500))
    return str(directory)


def _main(argv):
    try:
        return main(argv)
    finally:
        gin.clear_config()


def _snapshot(directory):
    """{path: sha256} of every file under `directory` but the run locks."""
    out = {}
    for d, _, files in os.walk(directory):
        for f in files:
            if not f.startswith(".lock"):
                path = os.path.join(d, f)
                with open(path, "rb") as handle:
                    out[os.path.relpath(path, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return out


def _check(argv, expected, capsys, run=None):
    before = _snapshot(run) if run else None
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 2
        if not isinstance(exit_.code, int):
            print(exit_.code, file=__import__("sys").stderr)
    finally:
        gin.clear_config()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("zeroflax: error:")]
    assert code == 2, (code, err[-3000:])
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1 and expected in lines[0], err[-3000:]
    if run:
        assert _snapshot(run) == before, "the run directory changed"


CASES = ([pytest.param("gin", name, id=f"gin-{name}") for name, _ in GIN_CASES]
         + [pytest.param("flag", name, id=f"flag-{name}") for name, _, _ in FLAG_CASES]
         + [pytest.param("data", name, id=f"data-{name}") for name, _, _ in DATA_CASES]
         + [pytest.param("checkpoint", name, id=f"checkpoint-{name}") for name, *_ in CHECKPOINT_CASES]
         + [pytest.param("env", name, id=f"env-{name}") for name, *_ in ENV_CASES])


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 50, len(CASES)


@pytest.mark.parametrize("kind,name", CASES)
def test_malformed_input_is_one_line_error(kind, name, finished_run, data_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # gin includes are relative to the repository root, as the README runs them
    fill = lambda items: [x.format(run=str(tmp_path / "run"), data=data_dir, tmp=str(tmp_path)) for x in items]
    if kind == "gin":
        # The tiny job as a gin file, before the malformed one: bindings (--gin_param) would override it.
        base = tmp_path / "tiny.gin"
        base.write_text("\n".join(tiny_bindings(tmp_path / "w", steps=2)[1::2]) + "\n")
        _check(["train", "--gin_file", TINY, "--gin_file", str(base), "--gin_file", _gin(name)], dict(GIN_CASES)[name],
               capsys)
    elif kind == "flag":
        argv, expected = next((a, e) for n, a, e in FLAG_CASES if n == name)
        shutil.copytree(finished_run, tmp_path / "run")
        _check(fill(argv), expected.format(tmp=str(tmp_path)), capsys, run=str(tmp_path / "run"))
    elif kind == "data":
        expected = next(e for n, _, e in DATA_CASES if n == name)
        _check(["train", "--gin_file", TINY, *tiny_bindings(tmp_path / "w", steps=2),
                "--gin_param", f"TrainConfig.data = '{os.path.join(data_dir, name)}'"], expected, capsys)
    elif kind == "env":
        variables, expected = next((v, e) for n, v, e in ENV_CASES if n == name)
        run = str(tmp_path / "run")
        shutil.copytree(finished_run, run)
        with socket.socket() as held, socket.socket() as probe:
            held.bind(("127.0.0.1", 0))
            held.listen()
            probe.bind(("127.0.0.1", 0))  # released below: a port nobody listens on
            ports = dict(held=held.getsockname()[1], silent=probe.getsockname()[1])
            probe.close()
            for variable in ("ZEROFLAX_COORDINATOR", "ZEROFLAX_NUM_PROCESSES", "ZEROFLAX_PROCESS_ID",
                             "ZEROFLAX_HEARTBEAT_TIMEOUT", "ZEROFLAX_INIT_TIMEOUT", "ZEROFLAX_CPU_DEVICES"):
                monkeypatch.delenv(variable, raising=False)
            for variable, value in variables.items():
                monkeypatch.setenv(variable, value.format(**ports))
            _check(["train", "--gin_file", TINY, *tiny_bindings(run, steps=4), "--resume"], expected.format(**ports),
                   capsys, run=run)
    else:
        damage, argv, expected = next((d, a, e) for n, d, a, e in CHECKPOINT_CASES if n == name)
        run = str(tmp_path / "run")
        shutil.copytree(finished_run, run)
        if damage:
            DAMAGE[damage](run)
        argv = fill(argv)
        if argv[0] == "train":
            argv = argv[:3] + tiny_bindings(run, steps=4) + argv[3:]
        _check(argv, expected, capsys, run=run)

"""NVMe offload (OffloadOptimizerConfig.device = 'nvme'): the master weights and optimizer state in a file,
streamed through host buffers chunk by chunk, train as host offload does; the file moves the bytes of the
theory; checkpoints snapshot it and restore bitwise; a crash leaves no checkpoint that restores to a
mixed state (the kill tests and a run of two processes are slow: tests/test_nvme_runs.py).

Numerics: fp32, 5 adamw steps on 8 simulated devices, 2 micro-batches per step, clipping at 0.5, against
the same engine with the state in host memory (tests/test_offload.py ties that to the run without
offload, and tests/test_equivalence.py that to optax). Chunks of at most 50 elements (the GPT: 1000), so
leaves are cut into several.
"""
import functools
import os

import jax
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax import Config, ConfigError, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.checkpoint import Checkpointer, CheckpointError, snapshot_dir
from zeroflax.disk import files as disk_files
from zeroflax.disk.store import MixedState
from zeroflax.step.streamed_update import disk_theory
from test_equivalence import adamw, engine_run, make_case
from tolerance import runs_agree

HOST = OffloadOptimizerConfig("cpu")


def nvme(path, buffer_size=50, **changes):
    return OffloadOptimizerConfig("nvme", nvme_path=str(path), buffer_size=buffer_size, buffer_count=3, **changes)


def base_config(stage, **changes):
    return Config(zero_stage=stage, micro_batch_size=2, grad_accum_steps=2, persistence_threshold=0, grad_clip=0.5,
                  **changes)


@functools.lru_cache(maxsize=None)
def host_run(model, stage):
    boxed, loss, batches = make_case(model, 0)
    params, _ = engine_run(loss, boxed, adamw(weight_decay=0.1), batches, base_config(stage, offload_optimizer=HOST))
    return params


@pytest.mark.parametrize("model,stage", [("odd", 1), ("odd", 2), ("odd", 3),
                                         pytest.param("gpt", 3, marks=pytest.mark.slow)])  # the GPT: make test-slow
def test_nvme_trains_as_host_offload(tmp_path, model, stage):
    boxed, loss, batches = make_case(model, 0)
    chunk = 50 if model == "odd" else 1000  # the GPT's 34k parameters in about 40 chunks
    engine, state = zeroflax.initialize(loss, boxed, adamw(weight_decay=0.1),
                                        base_config(stage, offload_optimizer=nvme(tmp_path, chunk)))
    assert state.params is None and state.opt_state is None  # they are in the file
    store = engine.state_files
    moved = []
    for batch in batches:
        before = store.bytes_moved
        state, metrics = engine.step(state, batch)
        after = store.bytes_moved
        moved.append((after[0] - before[0], after[1] - before[1]))
    params = jax.device_get(engine.model_params(state))
    runs_agree(params, host_run(model, stage), 1e-6, "NVMe against host offload")
    # Every chunk's record read and written once per step, each in whole 4096-byte blocks: the theory (the
    # master weights and Adam's two slots, 12 bytes per parameter, once each way) plus the alignment.
    read, written = disk_theory(engine.update.layout)
    num_params = sum(x.size for x in jax.tree.leaves(params))
    assert read == written == 12 * num_params
    extents = sum(disk_files.aligned(n) for n in engine.update.layout.record_sizes)
    print(f"disk per step: read {moved[-1][0]} written {moved[-1][1]} theory {read} ({moved[-1][0] / read:.2f}x)")
    assert all(m == (extents, extents) for m in moved)
    assert len(engine.update.layout.chunks) > len(jax.tree.leaves(params))  # leaves were cut into chunks


def test_checkpoint_snapshots_the_files_and_restores_bitwise(tmp_path):
    boxed, loss, batches = make_case("odd", 0)
    config = base_config(3, offload_optimizer=nvme(tmp_path / "state"))
    engine, state = zeroflax.initialize(loss, boxed, adamw(), config)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1, keep=2, asynchronous=False)
    for i, batch in enumerate(batches[:3]):
        state, _ = engine.step(state, batch)
        checkpoints.save(i + 1, state, {}, {}, view=engine.model_order, files=engine.state_files)
    # keep=2: the snapshot of step 1 went with its checkpoint
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "3", "nvme_2", "nvme_3"]
    for batch in batches[3:]:
        state, _ = engine.step(state, batch)
    expected = jax.device_get(engine.model_params(state))
    engine.state_files.close()

    # A new engine on the same files restores step 2 (the files are copied back) and trains on.
    engine2, fresh = zeroflax.initialize(loss, boxed, adamw(), config)
    restored, _, _ = checkpoints.restore(2, engine2.model_order(fresh), engine2.state_shardings,
                                         files=engine2.state_files)
    state2 = engine2.storage_order(restored)
    assert int(state2.step) == 2
    for batch in batches[2:]:
        state2, _ = engine2.step(state2, batch)
    for a, b in zip(jax.tree.leaves(jax.device_get(engine2.model_params(state2))), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    checkpoints.close()


def test_an_interrupted_update_and_a_stale_state_are_refused(tmp_path):
    boxed, loss, batches = make_case("odd", 0)
    config = base_config(2, offload_optimizer=nvme(tmp_path / "state"))
    engine, state = zeroflax.initialize(loss, boxed, adamw(), config)
    state, _ = engine.step(state, batches[0])
    # Step 1's update applied again (a state the engine returned before, stepped a second time) would mix steps.
    with pytest.raises(ValueError, match="holds the state after step 1, but this TrainState is at step 0"):
        engine.update.finish(state, {"grad_norm": 1.0})
    store = engine.state_files
    disk_files.mark_dirty(store.directory, 2)  # what a kill in the middle of step 2's update leaves
    with pytest.raises(MixedState, match="being rewritten for step 2"):
        engine.step(state, batches[1])
    with pytest.raises(MixedState):
        store.snapshot(str(tmp_path / "snap"))
    assert not os.path.exists(tmp_path / "snap")


def test_a_full_disk_is_one_error_naming_the_path(tmp_path, monkeypatch):
    boxed, loss, _ = make_case("odd", 0)
    monkeypatch.setattr(disk_files.shutil, "disk_usage", lambda path: type("U", (), {"free": 1000})())
    with pytest.raises(disk_files.DiskFull, match="OffloadOptimizerConfig.nvme_path: .* needs .* free"):
        zeroflax.initialize(loss, boxed, adamw(), base_config(3, offload_optimizer=nvme(tmp_path)))
    assert not os.path.exists(tmp_path / "process_0" / "state.bin")


def test_a_checkpoint_without_the_files_is_refused(tmp_path):
    boxed, loss, batches = make_case("odd", 0)
    engine, state = zeroflax.initialize(loss, boxed, adamw(), base_config(2, offload_optimizer=HOST))
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1, asynchronous=False)
    checkpoints.save(0, state, {}, {}, view=engine.model_order, files=engine.state_files)
    engine2, fresh = zeroflax.initialize(loss, boxed, adamw(), base_config(2, offload_optimizer=nvme(tmp_path / "s")))
    with pytest.raises(CheckpointError, match="no copy of the NVMe"):
        checkpoints.restore(0, engine2.model_order(fresh), engine2.state_shardings, files=engine2.state_files)
    assert not os.path.exists(snapshot_dir(checkpoints.directory, 0))


@pytest.mark.parametrize("optimizer,what", [
    (optax.lamb(1e-3), "differs from its update of the whole"),
    # below Config.grad_clip (0.5), so that it clips: the whole tree and a chunk by different factors
    (optax.chain(optax.clip_by_global_norm(0.01), optax.adam(1e-3)), "differs from its update of the whole"),
    (optax.adafactor(1e-3, min_dim_size_to_factor=2), "another shape"),
])
def test_an_optimizer_that_is_not_elementwise_is_refused(tmp_path, optimizer, what):
    boxed, loss, _ = make_case("odd", 0)
    with pytest.raises(ConfigError, match=f"OffloadOptimizerConfig.device: .*{what}"):
        zeroflax.initialize(loss, boxed, optimizer, base_config(2, offload_optimizer=nvme(tmp_path)))


@pytest.mark.parametrize("optimizer", [optax.sgd(0.1, momentum=0.9), optax.lion(1e-3)], ids=["sgd", "lion"])
def test_elementwise_optimizers_are_accepted(tmp_path, optimizer):
    boxed, loss, batches = make_case("odd", 0)
    engine, state = zeroflax.initialize(loss, boxed, optimizer, base_config(2, offload_optimizer=nvme(tmp_path)))
    state, metrics = engine.step(state, batches[0])
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("make,key", [
    (lambda p: OffloadOptimizerConfig("nvme"), "OffloadOptimizerConfig.nvme_path"),
    (lambda p: OffloadOptimizerConfig("cpu", nvme_path=str(p)), "OffloadOptimizerConfig.nvme_path"),
    (lambda p: OffloadOptimizerConfig("nvme", nvme_path=str(p), update="device"), "OffloadOptimizerConfig.update"),
    (lambda p: OffloadOptimizerConfig("nvme", nvme_path=str(p), delayed_update=True),
     "OffloadOptimizerConfig.delayed_update"),
    (lambda p: OffloadOptimizerConfig("nvme", nvme_path=str(p), buffer_count=1), "OffloadOptimizerConfig.buffer_count"),
    (lambda p: OffloadParamConfig("nvme"), "OffloadParamConfig.device"),
    (lambda p: Config(zero_stage=3, offload_optimizer=nvme(p), offload_param=OffloadParamConfig("cpu")),
     "OffloadParamConfig.device"),
    (lambda p: Config(zero_stage=0, offload_optimizer=nvme(p)), "OffloadOptimizerConfig.device"),
])
def test_invalid_nvme_settings_name_the_key(tmp_path, make, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        make(tmp_path)


def test_reports_give_the_disk_column_and_the_disk_bytes(tmp_path):
    boxed, loss, batches = make_case("odd", 0)
    engine, state = zeroflax.initialize(loss, boxed, adamw(), base_config(3, offload_optimizer=nvme(tmp_path)))
    before = zeroflax.comm_report(engine, state, batches[0])
    assert before.disk_read == -1 and "(no step)" in str(before)  # nothing measured before a step
    state, _ = engine.step(state, batches[0])
    comm = zeroflax.comm_report(engine, state, batches[0])
    num_params = sum(x.size for x in jax.tree.leaves(engine.abstract_params))
    assert comm.disk_read_theory == comm.disk_written_theory == 12 * num_params
    extents = sum(disk_files.aligned(n) for n in engine.update.layout.record_sizes)
    assert comm.disk_read == comm.disk_written == extents
    assert comm.host_to_device == comm.device_to_host == 0  # nothing crosses memory kinds inside the program
    memory = zeroflax.memory_report(engine, state, batches[0])
    assert memory.params == memory.opt_state == 0  # not in the state: in the file
    assert memory.disk == os.path.getsize(os.path.join(engine.state_files.directory, "state.bin")) / 8
    assert memory.theory_disk > 0 and memory.theory_host == 0
    assert memory.host_buffers == engine.update.host_buffer_bytes() > 0
    assert "state on disk" in str(memory) and "disk read (process)" in str(comm)

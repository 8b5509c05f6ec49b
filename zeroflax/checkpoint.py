"""Checkpoints with orbax: asynchronous, keep-N, every K steps, restorable on any mesh.

One checkpoint holds four items, written atomically together (orbax writes into a temporary
directory and renames it when every item is complete, so a crash mid-save leaves the previous
checkpoint as the newest complete one):

    params   the fp32 master parameters
    train    optimizer state, loss-scale state, step and rng
    data     the data loader's position (JSON)
    meta     what is needed to rebuild the model without the training config (JSON)
    sync     1-bit Adam only: its error buffers and last exchanged momentum, with their layout (JSON,
             `sync_layout`); restored where the layout matches (same device count), else reset (`notes`)

With the state on disk (NVMe offload) the master weights and optimizer state are not orbax items: the
state's files are copied, before the orbax save starts and between two steps, into `nvme_<step>/` beside
the step's directory (`disk/store.py: StateStore.snapshot`: a temporary directory renamed when complete).
A checkpoint is complete when orbax's step directory is, and that directory is only begun after its
snapshot was renamed into place, so a kill at any moment leaves every complete checkpoint with its files;
a restore copies them back (docs/offload.md, "NVMe: what a crash leaves").

Arrays are stored as global arrays, not per-device shards, so a restore only needs the abstract
target with the *new* shardings (another ZeRO stage, another device count, or one CPU device):
no conversion step.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from zeroflax.sharding.padding import stored_shape
from zeroflax.sharding.policy import is_none


class CheckpointError(RuntimeError):
    """A checkpoint directory is missing, empty, corrupt or incompatible; the message names it."""


class SaveError(RuntimeError):
    """The run could not write its checkpoint or its logs (a full disk, a quota, a lost mount). The run
    stops there; the newest complete checkpoint is left as it was (docs/reliability.md)."""


# How tensorstore reports the operating system's error inside orbax's exceptions.
_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")


def write_failure(error: BaseException) -> str:
    """The operating system's reason a write failed ("No space left on device"), from an OSError or
    from the tensorstore error orbax raises; else the error's first line."""
    seen = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return os.strerror(seen.errno)
        found = _OS_ERROR_CODE.search(str(seen))
        if found:
            return os.strerror(int(found.group(1)))
        seen = seen.__cause__ or seen.__context__
    return str(error).splitlines()[0][:300] if str(error) else type(error).__name__


def is_disk_full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)


def complete_steps(directory: str) -> list[int]:
    """The steps with a complete checkpoint in `directory`, read from the directory itself (orbax names a
    checkpoint's directory by its step only once every item is written)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def _train_item(state) -> dict:
    """The 'train' item of a TrainState (of arrays, or of their shardings): all but the parameters.
    Model state (e.g. BatchNorm statistics) is part of it when the model has any."""
    item = {"loss_scale": state.loss_scale, "step": state.step, "rng": state.rng}
    if state.opt_state is not None:  # None: on disk, in the checkpoint's file snapshot
        item["opt_state"] = state.opt_state
    if state.model_state is not None:
        item["model_state"] = state.model_state
    if state.pending_grads is not None:  # offload's delayed update: the gradient the next step applies
        item["pending_grads"] = state.pending_grads
    return item


def _train_item_like(shardings, state) -> dict:
    """The 'train' item of a TrainState of shardings, with the entries `state`'s has (a stored state drops
    what is remade after a restore)."""
    item = _train_item(shardings)
    return {key: item[key] for key in _train_item(state)}


def sync_layout(sync_state) -> list:
    """The shapes the sync state's meaning depends on (they encode the device count and each leaf's chunking)."""
    return [None if x is None else list(x.shape) for x in jax.tree.leaves(sync_state, is_leaf=is_none)]


def _abstract_with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _by_path(tree) -> dict:
    return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _params_item(state) -> dict:
    return {} if state.params is None else {"params": state.params}


def snapshot_dir(directory: str, step: int) -> str:
    """Where the checkpoint of `step` keeps its copy of the NVMe offload's files."""
    return os.path.join(directory, f"nvme_{step}")


def true_shapes(state) -> dict:
    """The 'shapes' item: path -> true shape of every array of the parameters and the 'train' item.

    The arrays themselves are stored as the engine holds them: a leaf that the data size does not divide
    is padded with zeros (sharding.padding). Restoring cuts or pads each to the restoring engine's stored
    shape (orbax's non-strict restore), after checking that the true shapes are the engine's."""
    return {path: list(np.shape(x)) for path, x in _by_path({**_params_item(state), "train": _train_item(state)}).items()}


def _check_shapes(saved: dict, expected: dict, step: int, directory: str) -> None:
    """CheckpointError naming the first leaves whose true shape differs between the checkpoint and the engine."""
    wrong = [f"{path} is {saved[path]} in the checkpoint, {shape} here" for path, shape in expected.items()
             if path in saved and list(saved[path]) != list(shape)]
    if wrong:
        raise CheckpointError(f"the checkpoint of step {step} in {directory} was written for another model: "
                              + "; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))


class Checkpointer:
    def __init__(self, directory: str, *, every: int = 100, keep: int = 3, asynchronous: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=asynchronous,
            create=True, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.notes: list[str] = []  # what the last restore could not restore as it was, for the log
        self.in_flight: int | None = None  # the step of the asynchronous save not yet known complete

    def _writing(self, step: int, action):
        """Run an orbax call that writes (or waits for) the checkpoint of `step`; its failure is a SaveError."""
        try:
            return action()
        except Exception as error:  # orbax and tensorstore raise ValueError, OSError, ...
            raise SaveError(f"the checkpoint of step {step} could not be written to {self.directory}: "
                            f"{write_failure(error)}") from error

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state, data_state: dict, meta: dict, *, force: bool = False, view=None,
             shapes: dict | None = None, files=None) -> bool:
        """Start saving (asynchronously); returns whether a checkpoint is being written at this step.
        `view` (e.g. `Engine.model_order`) turns the state into what is stored, only when a save happens;
        `shapes` (`true_shapes` of the engine's true abstract state) is written with it when the arrays are
        stored padded; `files` (`Engine.state_files`: the NVMe offload's store, or None) is snapshotted
        first, synchronously (the next step rewrites it)."""
        if not force and not self.manager.should_save(step):
            return False
        self.wait()  # the previous save's failure is reported as that step's
        if files is not None and step not in self.manager.all_steps():  # (a complete one's copy is never touched)
            self._writing(step, lambda: files.snapshot(snapshot_dir(self.directory, step)))
        if view is not None:
            state = view(state)
        items = dict(train=ocp.args.StandardSave(_train_item(state)),
                     data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta))
        if state.params is not None:
            items.update(params=ocp.args.StandardSave(state.params))
        if shapes is not None:
            items.update(shapes=ocp.args.JsonSave(shapes))
        if state.compute_params is not None:  # offload's predicted compute copy (Engine.model_order keeps only that)
            items.update(compute=ocp.args.StandardSave(state.compute_params))
        if state.sync_state is not None:
            items.update(sync=ocp.args.StandardSave(state.sync_state),
                         sync_layout=ocp.args.JsonSave(sync_layout(state.sync_state)))
        started = self._writing(step, lambda: self.manager.save(step, args=ocp.args.Composite(**items), force=force))
        if started:
            self.in_flight = step
        if files is not None:
            self._prune_snapshots(keep={step})
        return started

    def _prune_snapshots(self, keep: set) -> None:
        """Remove the file snapshots whose checkpoint orbax has removed (keep-N), or never completed."""
        live = set(self.manager.all_steps()) | keep
        for name in os.listdir(self.directory):
            if name.startswith("nvme_") and name[5:].isdigit() and int(name[5:]) not in live:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def restore(self, step: int | None, state, shardings, *, compute_copy: bool = False, true_state=None, files=None):
        """(state, data_state, meta) at `step` (default: the newest complete one), placed with `shardings`
        (a TrainState of shardings); `state` supplies the structure, stored shapes and dtypes, `true_state`
        (the engine's `abstract_state(stored=False)`) the true shapes, which must be the checkpoint's (each
        array is cut or zero-padded from the checkpoint's padding to this engine's). The offload compute
        copy is None (`Engine.storage_order` remakes it from the master weights) unless `compute_copy`
        asks for the stored one (the delayed update's prediction) and the checkpoint has it. `files` (the
        NVMe offload's store) gets the checkpoint's snapshot of its files back."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        self.notes = []
        saved = self.saved_shapes(step)
        if true_state is not None:
            _check_shapes(saved, true_shapes(true_state), step, self.directory)
        else:  # without the true shapes, each array must at least pad to this engine's stored shape
            targets = _by_path({**_params_item(state), "train": _train_item(state)})
            placed = _by_path({**_params_item(shardings), "train": _train_item_like(shardings, state)})
            _check_shapes({path: list(stored_shape(shape, placed[path])) for path, shape in saved.items() if path in placed},
                          {path: list(np.shape(x)) for path, x in targets.items()}, step, self.directory)
        sync = None
        if state.sync_state is not None:
            sync = self._restore_sync(step, state.sync_state, shardings.sync_state)
        # Not strict: a leaf written with another padding is cut or zero-padded to this engine's (the true
        # shapes were checked above when the caller gave them).
        items = dict(
            train=ocp.args.StandardRestore(_abstract_with_shardings(_train_item(state), _train_item_like(shardings, state)),
                                           strict=False),
            data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore())
        if state.params is not None:
            items.update(params=ocp.args.StandardRestore(_abstract_with_shardings(state.params, shardings.params),
                                                         strict=False))
        if files is not None:
            source = snapshot_dir(self.directory, step)  # the store reads its process's directory in it
            if not os.path.isdir(source):
                raise CheckpointError(f"the checkpoint of step {step} in {self.directory} has no copy of the NVMe "
                                      f"offload's files ({source}): it was written without OffloadOptimizerConfig"
                                      ".device='nvme'")
            held = files.restore(source)
            if held != step:
                raise CheckpointError(f"{source} holds the files of step {held}, not {step}")
        args = ocp.args.Composite(**items)
        try:
            restored = self.manager.restore(step, args=args)
        except Exception as error:  # orbax raises many types for a damaged directory
            raise CheckpointError(f"corrupt or incompatible checkpoint: cannot restore step {step} from {self.directory}: "
                                  f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
        t = restored["train"]
        compute = self._restore_compute_copy(step, state.compute_params, shardings.compute_params) if compute_copy else None
        new_state = state.replace(params=restored["params"] if state.params is not None else None, opt_state=t.get("opt_state"), loss_scale=t["loss_scale"],
                                  step=t["step"], rng=t["rng"], model_state=t.get("model_state"),
                                  pending_grads=t.get("pending_grads"), compute_params=compute,
                                  sync_state=state.sync_state if sync is None else sync)
        return new_state, restored["data"], restored["meta"]

    def saved_shapes(self, step: int) -> dict:
        """Path -> true shape of the checkpoint's arrays: its 'shapes' item, or (written unpadded, before
        the item existed) the arrays' own shapes."""
        return _saved_shapes(self.manager, step)

    def _restore_compute_copy(self, step: int, compute_params, shardings):
        """The stored compute copy, or None (and a note) where the checkpoint has none of this shape."""
        target = _abstract_with_shardings(compute_params, shardings)
        try:
            return self.manager.restore(step, args=ocp.args.Composite(compute=ocp.args.StandardRestore(target)))["compute"]
        except Exception:  # written without the prediction, or with another layout
            self.notes.append(f"the compute copy was remade from the master weights: the checkpoint of step {step} "
                              "holds no predicted copy of this layout, so the first step's gradient is not predicted")
            return None

    def _restore_sync(self, step: int, sync_state, shardings):
        """The stored sync state if its layout is this engine's, else None (and a note: it starts afresh, as
        DeepSpeed's does on every load)."""
        try:
            stored = self.manager.restore(step, args=ocp.args.Composite(sync_layout=ocp.args.JsonRestore()))
            layout = stored["sync_layout"]
        except Exception:  # written without 1-bit Adam
            layout = None
        if layout != sync_layout(sync_state):
            self.notes.append(f"the 1-bit error buffers reset: the checkpoint of step {step} was written "
                              + ("without 1-bit Adam" if layout is None else "with another device count or layout"))
            return None
        target = _abstract_with_shardings(sync_state, shardings)
        return self.manager.restore(step, args=ocp.args.Composite(sync=ocp.args.StandardRestore(target)))["sync"]

    def wait(self) -> None:
        """Wait for the save in flight; SaveError if it failed."""
        if self.in_flight is not None:
            self._writing(self.in_flight, self.manager.wait_until_finished)
            self.in_flight = None

    def close(self) -> None:
        self.wait()
        self.manager.close()


def _restore_items(directory: str, step: int | None, what: str, check=None, **items):
    """(step, restored items) from a read-only view of `directory`; `what` names them in errors; `check`
    (manager, step) runs first."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    manager = ocp.CheckpointManager(os.path.abspath(directory),
                                    options=ocp.CheckpointManagerOptions(read_only=True, create=False))
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise CheckpointError(f"no complete checkpoint in {directory}")
        if check is not None:
            check(manager, step)
        try:
            return step, manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as error:  # orbax raises many types for a damaged directory
            raise CheckpointError(f"corrupt or incompatible checkpoint: cannot restore the {what} of step {step} "
                                  f"from {directory} ({type(error).__name__})") from error
    finally:
        manager.close()


def _saved_shapes(manager, step: int) -> dict:
    try:
        return manager.restore(step, args=ocp.args.Composite(shapes=ocp.args.JsonRestore()))["shapes"]
    except Exception:  # no 'shapes' item: nothing was padded, the arrays have their true shapes
        pass
    try:
        metadata = manager.item_metadata(step)
        tree = {"train": metadata["train"]}
        if metadata.get("params") is not None:  # absent with NVMe offload (the files hold the master weights)
            tree["params"] = metadata["params"]
    except Exception as error:  # orbax raises many types for a damaged directory
        raise CheckpointError(f"corrupt or incompatible checkpoint: cannot read the array shapes of step {step} "
                              f"({type(error).__name__})") from error
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path): list(getattr(x, "shape", ())) for path, x in paths}


def read_meta(directory: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the newest complete checkpoint (or `step`) in `directory`."""
    step, restored = _restore_items(directory, step, "metadata", meta=ocp.args.JsonRestore())
    return step, restored["meta"]


def restore_params(directory: str, abstract_params: Any, sharding, step: int | None = None):
    """Only the parameters, in their true shapes (checked against the checkpoint's), every leaf placed with
    `sharding` (e.g. one CPU device)."""
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_params)
    expected = {"['params']" + jax.tree_util.keystr(path): list(x.shape)
                for path, x in jax.tree_util.tree_flatten_with_path(abstract_params)[0]}
    check = lambda manager, step: _check_shapes(_saved_shapes(manager, step), expected, step, directory)
    _, restored = _restore_items(directory, step, "parameters", check=check,
                                 params=ocp.args.StandardRestore(target, strict=False))
    return restored["params"]

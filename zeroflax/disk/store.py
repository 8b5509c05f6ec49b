"""The state's file on disk and what goes with it: one process's chunks of the master weights and optimizer
state (`disk/chunks.py`), the optimizer's shared leaves (step counts), and which step they hold.

Layout of `<nvme_path>/process_<i>/`:

    state.bin    the chunks' records (`disk/files.py`: preallocated, O_DIRECT where the filesystem allows)
    shared.npz   the optimizer state's leaves that belong to no parameter (written whole: a few scalars)
    STEP         the step whose update the files hold completely
    UPDATING     present while a step rewrites the records: the files mix two steps

A step marks the directory as updating, streams the records, writes `shared.npz` and commits the step. A
kill in between leaves UPDATING behind, and the store refuses to be used or snapshotted until it is
restored from a checkpoint's snapshot (`snapshot`, taken between steps, copies the three files
atomically, into a directory of this process's own beside the other processes'). docs/offload.md, "NVMe: what a crash leaves".
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from zeroflax.disk import files as disk
from zeroflax.disk.chunks import ChunkLayout

STATE, SHARED = "state.bin", "shared.npz"
KEY = "OffloadOptimizerConfig.nvme_path"


class MixedState(RuntimeError):
    """The files were being rewritten when a run stopped: they hold no single step's state."""


class StateStore:
    def __init__(self, directory: str, layout: ChunkLayout, *, buffer_count: int, io_threads: int, direct: bool):
        self.directory = os.path.abspath(directory)
        self.layout = layout
        self.buffer_count, self.io_threads, self.direct = buffer_count, io_threads, direct
        self._file = None
        self._pool = None

    # ------------------------------------------------------------------------------------ lifecycle
    def create(self) -> None:
        """A fresh file of this layout (preallocated: a disk too small fails here, with DiskFull)."""
        self.close()
        os.makedirs(self.directory, exist_ok=True)
        for name in ("STEP", "UPDATING", SHARED):
            if os.path.exists(os.path.join(self.directory, name)):
                os.remove(os.path.join(self.directory, name))
        self._file = disk.RecordFile(os.path.join(self.directory, STATE), self.layout.record_sizes, key=KEY,
                                     create=True, direct=self.direct)

    def open(self) -> None:
        if self._file is None:
            self._file = disk.RecordFile(os.path.join(self.directory, STATE), self.layout.record_sizes, key=KEY,
                                         create=False, direct=self.direct)

    @property
    def file(self) -> disk.RecordFile:
        self.open()
        return self._file

    @property
    def buffer_bytes(self) -> int:
        """The host memory of the stream's buffers: buffer_count records of the largest chunk's size."""
        return self.buffer_count * disk.aligned(max(self.layout.largest, 1))

    def file_bytes(self) -> int:
        """The size of the state's file on disk (0 before it exists)."""
        path = os.path.join(self.directory, STATE)
        return os.path.getsize(path) if os.path.exists(path) else 0

    def streamer(self) -> disk.Streamer:
        if self._pool is None:
            self._pool = disk.BufferPool(self.buffer_count, self.buffer_bytes // self.buffer_count)
        return disk.Streamer(self.file, self._pool, threads=self.io_threads)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # ------------------------------------------------------------------------------------- steps
    def step(self) -> int | None:
        """The step the files hold; MixedState if a step's rewrite was interrupted."""
        committed, updating = disk.file_state(self.directory)
        if updating is not None:
            raise MixedState(f"{self.directory} was being rewritten for step {updating} when its run stopped: it "
                             f"mixes two steps. Resume from a checkpoint (its snapshot restores the files), or "
                             f"start afresh")
        return committed

    def begin(self, step: int) -> None:
        disk.mark_dirty(self.directory, step)

    def commit(self, step: int, shared: list) -> None:
        self.file.flush()
        tmp = os.path.join(self.directory, SHARED + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, *[np.asarray(x) for x in shared])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.directory, SHARED))
        disk.commit(self.directory, step)

    def shared(self) -> list:
        with np.load(os.path.join(self.directory, SHARED)) as f:
            return [f[f"arr_{i}"] for i in range(len(f.files))]

    # ------------------------------------------------------------------------------ checkpoints
    def snapshot(self, destination: str) -> None:
        """The files as of the last committed step, copied atomically into `destination`/process_<i> (each
        process of a run snapshots its own files beside the others')."""
        self.step()  # refuses a mixed state
        self.file.flush()
        os.makedirs(destination, exist_ok=True)
        target = self._within(destination)
        if os.path.isdir(target):  # a snapshot whose checkpoint never completed (a kill in between): taken anew
            shutil.rmtree(target)
        disk.snapshot(self.directory, target, [STATE, SHARED], key=KEY)

    def restore(self, source: str) -> int:
        """The files of a snapshot (`snapshot`'s `destination`) copied back; returns their step."""
        self.close()
        os.makedirs(self.directory, exist_ok=True)
        source = self._within(source)
        if not os.path.isdir(source):
            raise MixedState(f"{source} does not exist: the snapshot holds no files of this process")
        disk.restore_snapshot(source, self.directory, [STATE, SHARED], key=KEY)
        step = self.step()
        if step is None:
            raise MixedState(f"the snapshot {source} records no step")
        return step

    def _within(self, destination: str) -> str:
        return os.path.join(destination, os.path.basename(self.directory))

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """(read, written) bytes since the file was opened."""
        return (self._file.bytes_read, self._file.bytes_written) if self._file is not None else (0, 0)

"""Record files, buffer pool, streamer, step markers and snapshots of zeroflax.disk.files."""
import collections
import errno
import os
import pickle
import threading
import time

import numpy as np
import pytest

from zeroflax.disk import files
from zeroflax.disk.files import (ALIGN, BufferPool, DiskFull, RecordFile, Streamer, aligned, commit, file_state,
                                 mark_dirty, restore_snapshot, snapshot)

KEY = "OffloadOptimizerConfig.nvme_path"
ODD = [1, 4095, 4096, 4097, 10000, 0, 3]
Usage = collections.namedtuple("Usage", "total used free")


def fill(buf, n, seed):
    """Distinct bytes per record and seed, so a record read from the wrong place shows."""
    np.frombuffer(buf, np.uint8, n)[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def content(buf, n):
    return bytes(memoryview(buf)[:n])


def expected(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_aligned():
    assert [aligned(n) for n in (0, 1, 4095, 4096, 4097)] == [0, 4096, 4096, 4096, 8192]


@pytest.mark.parametrize("direct", [True, False])
def test_records_round_trip(tmp_path, direct):
    path = str(tmp_path / "sub" / "state.bin")
    f = RecordFile(path, ODD, key=KEY, create=True, direct=direct)
    if not direct:
        assert f.direct is False
    assert all(o % ALIGN == 0 for o in f.offsets)
    assert f.offsets == [0, 4096, 8192, 12288, 20480, 32768, 32768]
    assert f.total == sum(aligned(s) for s in ODD) == os.path.getsize(path)
    pool = BufferPool(2, max(ODD))
    buf = pool.acquire()
    for i, s in enumerate(ODD):
        fill(buf, aligned(s), i)
        f.write(i, buf)
    f.flush()
    f.close()
    f = RecordFile(path, ODD, key=KEY, create=False, direct=direct)
    out = pool.acquire()
    for i in reversed(range(len(ODD))):
        f.read(i, out)
        assert content(out, aligned(ODD[i])) == expected(aligned(ODD[i]), i)
    assert f.bytes_read == f.total and f.bytes_written == 0
    with pytest.raises(ValueError, match="needs a buffer of 12288"):
        f.read(4, bytearray(100))
    with pytest.raises(IndexError):
        f.read(len(ODD), out)
    f.close()
    pool.close()


def test_buffered_mode_drops_the_pages_it_moved(tmp_path, monkeypatch):
    real, dropped = os.posix_fadvise, []

    def record(fd, off, n, advice):
        dropped.append((off, n, advice))
        return real(fd, off, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    f = RecordFile(str(tmp_path / "a"), [10, 5000], key=KEY, create=True, direct=False)
    buf = BufferPool(1, 5000).acquire()
    f.write(1, buf)
    f.read(0, buf)
    assert dropped == [(4096, 8192, os.POSIX_FADV_DONTNEED), (0, 4096, os.POSIX_FADV_DONTNEED)]


def test_short_transfers_are_continued(tmp_path, monkeypatch):
    real_preadv, real_pwrite = os.preadv, os.pwrite
    # at most one page per call, as the kernel may do (signals, some filesystems)
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: real_preadv(fd, [memoryview(bufs[0])[:ALIGN]], off))
    monkeypatch.setattr(os, "pwrite", lambda fd, data, off: real_pwrite(fd, data[:ALIGN], off))
    f = RecordFile(str(tmp_path / "a"), [10, 10000], key=KEY, create=True)
    pool = BufferPool(2, 10000)
    a, b = pool.acquire(), pool.acquire()
    fill(a, 12288, 3)
    f.write(1, a)
    f.read(1, b)
    assert content(b, 12288) == expected(12288, 3)
    assert f.bytes_written == f.bytes_read == 12288


def test_direct_falls_back_when_open_refuses(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    f = RecordFile(str(tmp_path / "a"), [5000], key=KEY, create=True)
    assert f.direct is False
    pool = BufferPool(1, 5000)
    buf = pool.acquire()
    fill(buf, 8192, 7)
    f.write(0, buf)
    buf[:] = bytes(len(buf))
    f.read(0, buf)
    assert content(buf, 8192) == expected(8192, 7)
    assert f.bytes_written == f.bytes_read == 8192


def test_direct_falls_back_when_first_io_refuses(tmp_path, monkeypatch):
    real_preadv, calls = os.preadv, []

    def refuse_first(fd, bufs, off):
        calls.append(off)
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "O_DIRECT I/O refused")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", refuse_first)
    f = RecordFile(str(tmp_path / "a"), [10], key=KEY, create=True)
    assert f.direct is False and calls == [0]
    buf = BufferPool(1, 10).acquire()
    f.read(0, buf)
    assert content(buf, ALIGN) == bytes(ALIGN)  # preallocated space reads as zeros


def test_open_existing_checks_layout(tmp_path):
    path = str(tmp_path / "a")
    with pytest.raises(ValueError, match=f"{path}.*8192 bytes.*no file"):
        RecordFile(path, [1, 1], key=KEY, create=False)
    RecordFile(path, [1, 1], key=KEY, create=True).close()
    with pytest.raises(ValueError, match=f"{path}: expected a file of 12288 bytes.*found 8192 bytes"):
        RecordFile(path, [1, 5000], key=KEY, create=False)
    RecordFile(path, [1, 5000], key=KEY, create=True).close()  # recreated with the new layout
    assert os.path.getsize(path) == 12288
    RecordFile(path, [1, 5000], key=KEY, create=False).close()


class CountingPool(BufferPool):
    """Counts the buffers out, independently of the pool's own bookkeeping."""

    def __init__(self, *a):
        super().__init__(*a)
        self.out = self.most = 0

    def acquire(self, timeout=None):
        buf = super().acquire(timeout)
        self.out += 1
        self.most = max(self.most, self.out)
        return buf

    def release(self, buf):
        self.out -= 1
        super().release(buf)


SIZES = [(i * 1777) % 9000 + 1 for i in range(20)]


def streamed(tmp_path, direct=True):
    f = RecordFile(str(tmp_path / "s.bin"), SIZES, key=KEY, create=True, direct=direct)
    pool = CountingPool(3, max(SIZES))
    return f, pool, Streamer(f, pool, threads=2)


@pytest.mark.parametrize("direct", [True, False])
def test_streamer_reads_what_was_written(tmp_path, direct):
    f, pool, s = streamed(tmp_path, direct)
    for i, n in enumerate(SIZES):
        buf = s.buffer()
        fill(buf, aligned(n), i)
        s.write_new(i, buf)
    s.drain()
    assert pool.out == 0
    pool.most, seen = 0, []
    for i, buf in s.reads(range(20)):
        if not seen:  # the reads behind the first went ahead, as far as the pool allows
            assert pool.out == 3
        seen.append(i)
        assert content(buf, aligned(SIZES[i])) == expected(aligned(SIZES[i]), i)
        fill(buf, aligned(SIZES[i]), 100 + i)
        s.write(i, buf)
    assert seen == list(range(20))
    # no drain in between: a record's queued write must land before the record is read again
    order = [19, 0, 7, 3, 12]
    seen = []
    for i, buf in s.reads(order):
        seen.append(i)
        assert content(buf, aligned(SIZES[i])) == expected(aligned(SIZES[i]), 100 + i)
        s.release(buf)
    assert seen == order
    s.drain()
    s.close()
    assert pool.most == 3 and pool.peak == 3  # the reads went ahead, never past the pool
    assert pool.out == 0 and pool.in_use == 0
    moved = sum(aligned(n) for n in SIZES)
    assert f.bytes_written == 2 * moved
    assert f.bytes_read == moved + sum(aligned(SIZES[i]) for i in order)


def test_streamer_reads_a_record_only_after_its_queued_write(tmp_path, monkeypatch):
    f, pool, s = streamed(tmp_path)
    real_pwrite = os.pwrite

    def slow(fd, data, off):
        time.sleep(0.1)
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "pwrite", slow)
    buf = s.buffer()
    fill(buf, aligned(SIZES[4]), 44)
    s.write_new(4, buf)
    for i, buf in s.reads([4]):
        assert content(buf, aligned(SIZES[4])) == expected(aligned(SIZES[4]), 44)
        s.release(buf)
    s.drain()


def test_streamer_read_error_surfaces_from_iterator(tmp_path, monkeypatch):
    f, pool, s = streamed(tmp_path)
    real_preadv = os.preadv

    def failing(fd, bufs, off):
        if off == f.offsets[5]:
            raise OSError(errno.EIO, "bad sector")
        return real_preadv(fd, bufs, off)

    monkeypatch.setattr(os, "preadv", failing)
    seen = []
    with pytest.raises(OSError, match="bad sector"):
        for i, buf in s.reads(range(20)):
            seen.append(i)
            s.write(i, buf)
    assert seen == [0, 1, 2, 3, 4]
    s.drain()
    assert pool.out == 0  # the failed read's buffer and those read ahead went back


def test_streamer_write_error_surfaces_at_drain(tmp_path, monkeypatch):
    f, pool, s = streamed(tmp_path)

    def failing(fd, data, off):
        raise OSError(errno.EIO, "write failed")

    monkeypatch.setattr(os, "pwrite", failing)
    for i, buf in s.reads([3]):  # one write: a second one could already report the first's error
        s.write(i, buf)
    with pytest.raises(OSError, match="write failed"):
        s.drain()
    with pytest.raises(OSError, match="write failed"):  # sticky: nothing may be committed after it
        s.write(0, s.buffer())
    assert pool.out == 0 and f.bytes_written == 0


def test_reads_ahead_do_not_wait_for_writes_behind(tmp_path, monkeypatch):
    f, pool, s = streamed(tmp_path)
    real_pwrite, go = os.pwrite, threading.Event()

    def held(fd, data, off):
        go.wait(5)
        return real_pwrite(fd, data, off)

    monkeypatch.setattr(os, "pwrite", held)
    start = time.monotonic()
    for i, buf in s.reads(range(20)):
        if i == 2:  # read ahead while writes 0 and 1 hold two of the three buffers and both threads
            assert time.monotonic() - start < 2
            go.set()
        s.write(i, buf)
    s.drain()
    assert pool.out == 0 and f.bytes_written == sum(aligned(n) for n in SIZES)


def test_close_returns_every_buffer(tmp_path):
    f, pool, s = streamed(tmp_path)
    with pytest.raises(ZeroDivisionError):
        try:
            for i, buf in s.reads(range(20)):
                s.write(i, buf) if i < 4 else 1 / 0
        finally:
            s.close()
    assert pool.out == 0
    s = Streamer(f, pool)
    it = s.reads(range(20))
    next(it)  # one held, two read ahead, the iterator alive
    s.close()
    assert pool.out == 0
    s = Streamer(f, pool)  # the pool is whole again: a full pass goes through
    assert sum(1 for i, buf in s.reads(range(20)) if s.release(buf) is None) == 20
    s.close()


def test_streamer_refuses_to_advance_while_a_buffer_is_held(tmp_path):
    f, pool, s = streamed(tmp_path)
    it = s.reads(range(20))
    next(it)
    with pytest.raises(RuntimeError, match="write\\(\\) or release\\(\\)"):
        next(it)
    assert pool.out == 1  # only the held one; the reads ahead went back


def test_buffer_pool():
    pool = BufferPool(2, 5000)
    a, b = pool.acquire(), pool.acquire()
    assert len(a) == 8192 and a is not b
    assert np.frombuffer(a, np.uint8).ctypes.data % ALIGN == 0
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    pool.release(a)
    with pytest.raises(ValueError):
        pool.release(a)
    with pytest.raises(ValueError):
        pool.release(bytearray(8192))
    assert pool.acquire() is a
    pool.close()


def test_disk_full_message():
    e = DiskFull(KEY, "/x/y", 3 * 2**29, int(0.2 * 2**30))
    assert str(e) == ("OffloadOptimizerConfig.nvme_path: /x/y needs 1.50 GiB but its filesystem has 0.20 GiB free "
                      "(free space or point nvme_path elsewhere)")
    assert isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_create_refuses_when_free_space_is_short(tmp_path, monkeypatch):
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: Usage(10**9, 10**9, 1000))
    path = str(tmp_path / "a")
    with pytest.raises(DiskFull) as e:
        RecordFile(path, [1, 5000], key=KEY, create=True)
    assert f"{KEY}: {path} needs 12288 bytes" in str(e.value) and "has 1000 bytes free" in str(e.value)
    assert not os.path.exists(path)


def test_create_turns_fallocate_enospc_into_disk_full(tmp_path, monkeypatch):
    def full(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    path = str(tmp_path / "a")
    with pytest.raises(DiskFull, match=f"{KEY}: {path} needs 8192 bytes but its filesystem has"):
        RecordFile(path, [8192], key=KEY, create=True)
    assert not os.path.exists(path)


def test_markers(tmp_path):
    d = str(tmp_path)
    assert file_state(d) == (None, None)
    mark_dirty(d, 1)
    assert file_state(d) == (None, 1)
    commit(d, 1)
    assert file_state(d) == (1, None)
    mark_dirty(d, 2)
    assert file_state(d) == (1, 2)
    commit(d, 2)
    assert file_state(d) == (2, None)
    assert sorted(os.listdir(d)) == ["STEP"]
    (tmp_path / "STEP").write_text("garbage")
    with pytest.raises(ValueError, match="expected a step number"):
        file_state(d)


NAMES = ["params.bin", "adam.bin"]


def live_state(tmp_path, seed):
    live = tmp_path / "live"
    pool = BufferPool(1, 20000)
    buf = pool.acquire()
    for k, name in enumerate(NAMES):
        f = RecordFile(str(live / name), [20000, 7], key=KEY, create=True)
        for i in range(2):
            fill(buf, aligned(f.sizes[i]), seed + 10 * k + i)
            f.write(i, buf)
        f.flush()
        f.close()
    pool.close()
    return str(live)


def read_all(directory):
    return {n: open(os.path.join(directory, n), "rb").read() for n in [*NAMES, "STEP"]}


def test_snapshot_and_restore_round_trip(tmp_path):
    live, snap = live_state(tmp_path, 0), str(tmp_path / "snaps" / "step3")
    mark_dirty(live, 3)
    with pytest.raises(ValueError, match="UPDATING"):
        snapshot(live, snap, NAMES, key=KEY)
    assert not os.path.exists(snap)
    commit(live, 3)
    before = read_all(live)
    snapshot(live, snap, NAMES, key=KEY)
    assert read_all(snap) == before and sorted(os.listdir(snap)) == sorted([*NAMES, "STEP"])
    assert not os.path.exists(snap + ".tmp")
    with pytest.raises(FileExistsError):
        snapshot(live, snap, NAMES, key=KEY)
    mark_dirty(live, 4)
    live_state(tmp_path, 1000)  # rewritten in place, then "crashed" before commit
    assert read_all(live) != before
    restore_snapshot(snap, live, NAMES, key=KEY)
    assert read_all(live) == before
    assert file_state(live) == (3, None)
    assert sorted(os.listdir(live)) == sorted([*NAMES, "STEP"])


def test_snapshot_falls_back_to_a_buffered_copy(tmp_path, monkeypatch):
    live = live_state(tmp_path, 0)
    commit(live, 1)

    def cross_device(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    snapshot(live, str(tmp_path / "snap"), NAMES, key=KEY)
    assert read_all(str(tmp_path / "snap")) == read_all(live)


def copies_fail_after_the_first(monkeypatch) -> list:
    """os.copy_file_range that copies once, then raises EIO; the list counts the calls."""
    real, calls = os.copy_file_range, []

    def fails_after_first(*a, **k):
        calls.append(1)
        if len(calls) > 1:
            raise OSError(errno.EIO, "I/O error")
        return real(*a, **k)

    monkeypatch.setattr(os, "copy_file_range", fails_after_first)
    return calls


def test_failed_snapshot_leaves_nothing(tmp_path, monkeypatch):
    live, snap = live_state(tmp_path, 0), str(tmp_path / "snap")
    commit(live, 1)
    calls = copies_fail_after_the_first(monkeypatch)
    with pytest.raises(OSError, match="I/O error"):
        snapshot(live, snap, NAMES, key=KEY)
    assert len(calls) == 2
    assert not os.path.exists(snap) and not os.path.exists(snap + ".tmp")


def test_snapshot_and_restore_check_free_space(tmp_path, monkeypatch):
    live, snap = live_state(tmp_path, 0), str(tmp_path / "snap")
    commit(live, 1)
    snapshot(live, snap, NAMES, key=KEY)
    needed = sum(len(v) for v in read_all(live).values())
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: Usage(10**9, 10**9, needed - 1))
    with pytest.raises(DiskFull, match=f"{KEY}: {snap}2 needs {needed} bytes but its filesystem has {needed - 1} "):
        snapshot(live, snap + "2", NAMES, key=KEY)
    assert not os.path.exists(snap + "2") and not os.path.exists(snap + "2.tmp")
    with pytest.raises(DiskFull, match=f"{KEY}: {live} needs {needed} bytes"):
        restore_snapshot(snap, live, NAMES, key=KEY)
    assert file_state(live) == (1, None)  # refused before anything was touched


def test_failed_restore_leaves_live_marked_mixed(tmp_path, monkeypatch):
    live, snap = live_state(tmp_path, 0), str(tmp_path / "snap")
    commit(live, 1)
    snapshot(live, snap, NAMES, key=KEY)
    copies_fail_after_the_first(monkeypatch)
    with pytest.raises(OSError, match="I/O error"):
        restore_snapshot(snap, live, NAMES, key=KEY)
    assert file_state(live) == (1, 1)
    assert sorted(os.listdir(live)) == sorted([*NAMES, "STEP", "UPDATING"])

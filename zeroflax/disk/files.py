"""Record files on a local disk for NVMe offload, streamed through a fixed pool of host buffers.

With ZeRO-Infinity-style offload the fp32 master weights and optimizer state live in files, and each
step streams them chunk by chunk: read a record, let the caller update it, write it back, while the
next records are read ahead and the previous ones written behind. Host memory must not grow with the
model, so nothing here maps files (np.memmap pages count in RSS and fill the page cache) or reads a
whole file: records move by positional I/O into the page-aligned buffers of a BufferPool, with
O_DIRECT where the filesystem takes it, else buffered I/O that drops the pages it touched.

Crash consistency is the caller's protocol, helped by two markers: mark_dirty() before rewriting
records (the files then mix two steps) and commit() once every write is drained and the file flushed.
snapshot()/restore_snapshot() copy a committed state to and from another directory.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import errno
import itertools
import mmap
import os
import shutil
import threading
import weakref

import numpy as np

ALIGN = 4096
_COPY_CHUNK = 8 << 20
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
_END = object()


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _human(n: int) -> str:
    # GiB reads well for model state; small sizes (tests, small layers) would all print as 0.00 GiB
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 // 100 else f"{n} bytes"


class DiskFull(OSError):
    """Not enough space at a path: the message names the path, the bytes needed and the bytes free,
    and the config key the caller passes (e.g. 'OffloadOptimizerConfig.nvme_path')."""

    def __init__(self, key: str, path: str, needed: int, free: int):
        self.key, self.path, self.needed, self.free = key, path, needed, free
        self.message = (f"{key}: {path} needs {_human(needed)} but its filesystem has {_human(free)} free "
                        f"(free space or point {key.rsplit('.', 1)[-1]} elsewhere)")
        super().__init__(errno.ENOSPC, self.message)

    def __str__(self):
        return self.message

    def __reduce__(self):  # OSError's would rebuild it from (errno, message)
        return DiskFull, (self.key, self.path, self.needed, self.free)


def _check_free(key: str, path: str, needed: int) -> None:
    existing = os.path.abspath(path)  # the path may not exist yet: its filesystem is its nearest ancestor's
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise DiskFull(key, path, needed, free)


try:  # not in Python's os module
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):
    _sync_file_range = None


def _write_out(fd: int, off: int, n: int) -> None:
    # DONTNEED drops only clean pages, so the range is written out first. Not durability (metadata is
    # not synced; RecordFile.flush() is). sync_file_range waits for this range only, where fdatasync
    # would also wait for every other thread's writes to the file.
    if _sync_file_range is None or _sync_file_range(fd, off, n, 7) != 0:  # WAIT_BEFORE|WRITE|WAIT_AFTER
        os.fdatasync(fd)


class RecordFile:
    """One preallocated file of fixed-size records at ALIGN-aligned offsets.

    read()/write() may run on several threads at once (positional I/O on one descriptor). A buffer
    holds at least aligned(size) bytes, and in direct mode starts ALIGN-aligned (a BufferPool's do);
    the bytes past a record's size are padding, stored as they are."""

    def __init__(self, path: str, sizes: list[int], *, key: str, create: bool, direct: bool = True):
        self.path, self.key, self.sizes = path, key, [int(s) for s in sizes]
        if any(s < 0 for s in self.sizes):
            raise ValueError(f"{path}: record sizes must be >= 0, got {self.sizes}")
        self.offsets = [0, *itertools.accumulate(aligned(s) for s in self.sizes)]
        self.total = self.offsets.pop()
        self.bytes_read = self.bytes_written = 0
        self._lock = threading.Lock()
        if create:
            self._create()
        elif not os.path.exists(path) or os.path.getsize(path) != self.total:
            found = f"{os.path.getsize(path)} bytes" if os.path.exists(path) else "no file"
            raise ValueError(f"{path}: expected a file of {self.total} bytes for {len(self.sizes)} records, "
                             f"found {found}")
        self._fd, self.direct = self._open(direct)

    def _create(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if os.path.exists(self.path):  # recreated: the space it holds is free for the new one
            os.unlink(self.path)
        _check_free(self.key, self.path, self.total)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if self.total:  # reserve every block now: a full disk shows here, not mid-step
                os.posix_fallocate(fd, 0, self.total)
        except OSError as e:
            os.unlink(self.path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                free = shutil.disk_usage(os.path.dirname(os.path.abspath(self.path))).free
                raise DiskFull(self.key, self.path, self.total, free) from e
            raise
        finally:
            os.close(fd)

    def _open(self, direct: bool) -> tuple[int, bool]:
        flags = os.O_RDWR | os.O_CLOEXEC
        if direct:
            try:
                fd = os.open(self.path, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
            else:
                # some filesystems take the flag at open and refuse the I/O: settle the mode here, once,
                # before threads share the descriptor
                try:
                    with mmap.mmap(-1, ALIGN) as scratch:
                        if self.total:
                            os.preadv(fd, [scratch], 0)
                    return fd, True
                except OSError as e:
                    os.close(fd)
                    if e.errno != errno.EINVAL:
                        raise
        return os.open(self.path, flags), False

    def _io(self, i: int, buf, write: bool) -> None:
        if not 0 <= i < len(self.sizes):
            raise IndexError(f"{self.path}: no record {i} in {len(self.sizes)}")
        n, off = aligned(self.sizes[i]), self.offsets[i]
        with memoryview(buf) as whole, whole.cast("B") as view:
            if len(view) < n:
                raise ValueError(f"{self.path}: record {i} needs a buffer of {n} bytes, got {len(view)}")
            # np.frombuffer takes read-only buffers too, unlike ctypes; an unaligned one would be EINVAL
            if self.direct and n and np.frombuffer(view, np.uint8).ctypes.data % ALIGN:
                raise ValueError(f"{self.path}: O_DIRECT needs a {ALIGN}-aligned buffer (use a BufferPool)")
            done = 0
            while done < n:  # the kernel may move fewer bytes than asked
                part, at = view[done:n], off + done
                moved = os.pwrite(self._fd, part, at) if write else os.preadv(self._fd, [part], at)
                if moved == 0:
                    raise OSError(errno.EIO, f"{self.path}: record {i} stopped at byte {done} of {n}")
                done += moved
        if not self.direct:
            if write:
                _write_out(self._fd, off, n)
            os.posix_fadvise(self._fd, off, n, os.POSIX_FADV_DONTNEED)
        with self._lock:
            if write:
                self.bytes_written += n
            else:
                self.bytes_read += n

    def read(self, i: int, buf) -> None:
        """Fill buf[:aligned(sizes[i])] from record i."""
        self._io(i, buf, write=False)

    def write(self, i: int, buf) -> None:
        """Write buf[:aligned(sizes[i])] to record i."""
        self._io(i, buf, write=True)

    def flush(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class BufferPool:
    """`count` page-aligned buffers of `nbytes` each (anonymous mmap), handed out and returned; acquire
    blocks while all are in use. The only host memory the streaming holds.

    A buffer is an `mmap.mmap` of max(ALIGN, aligned(nbytes)) bytes; np.frombuffer makes it an array.
    It is reused once released, so views of it must not outlive that, nor must jax arrays: on CPU,
    jax.device_put of such a view aliases it rather than copying (copy with np.array first)."""

    def __init__(self, count: int, nbytes: int):
        if count < 1 or nbytes < 0:
            raise ValueError(f"BufferPool needs count >= 1 and nbytes >= 0, got {count}, {nbytes}")
        self.count, self.nbytes = count, nbytes
        self._all = [mmap.mmap(-1, max(ALIGN, aligned(nbytes))) for _ in range(count)]  # mmap refuses 0
        self._free = list(self._all)
        self._cond = threading.Condition()
        self.in_use = self.peak = 0  # for tests and memory reports

    def acquire(self, timeout: float | None = None):
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"none of the pool's {self.count} buffers came back in {timeout} s")
            self.in_use += 1
            self.peak = max(self.peak, self.in_use)
            return self._free.pop()

    def release(self, buf) -> None:
        with self._cond:
            if not any(b is buf for b in self._all) or any(b is buf for b in self._free):
                raise ValueError("release() of a buffer that is not out of this pool")
            self._free.append(buf)
            self.in_use -= 1
            self._cond.notify()

    def close(self) -> None:
        for b in self._all:
            try:
                b.close()
            except BufferError:  # a view of it is still alive: the mapping goes when the view does
                pass


class Streamer:
    """Reads records ahead and writes them behind on a thread pool, through a BufferPool.

        for i, buf in streamer.reads(order):   # yields each record after its read
            ... caller modifies buf in place (or fills it) ...
            streamer.write(i, buf)              # queued; buf goes back to the pool once written
        streamer.drain()                        # waits for every queued write; re-raises the first I/O error

    One consumer thread. Each yielded buffer goes to write() or release() before the iterator is
    advanced: the read-ahead needs it (advancing without raises RuntimeError rather than hang).
    A write error is sticky: every later write() and drain() raises it, so nothing commits past it."""

    def __init__(self, file: RecordFile, pool: BufferPool, threads: int = 2):
        self.file, self.pool = file, pool
        self._ex = cf.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroflax-disk")
        self._writes: dict[int, cf.Future] = {}  # record -> its last queued write
        self._held: dict[int, object] = {}  # yielded buffers not handed back yet, by id
        self._readers = weakref.WeakSet()  # live reads() iterators, closed by close()
        self._error: BaseException | None = None

    def reads(self, order):
        gen = self._reads(iter(order))
        self._readers.add(gen)
        return gen

    def _reads(self, todo):
        pending, nxt = collections.deque(), _END  # nxt: taken from `todo`, not read yet
        try:
            while True:
                if self._held:
                    raise RuntimeError("pass each yielded buffer to write() or release() before advancing")
                # up to count - 1 reads ahead of the one yielded next: the whole pool
                while len(pending) < self.pool.count:
                    if nxt is _END and (nxt := next(todo, _END)) is _END:
                        break
                    try:  # only the next record waits for a buffer; reads ahead take the free ones, so
                        # the record already read is not held back while writes behind hold the rest
                        buf = self.pool.acquire(timeout=0 if pending else None)
                    except TimeoutError:
                        break
                    if nxt in self._writes:  # a queued write of this record must land before it is read
                        cf.wait([self._writes[nxt]])
                    pending.append((nxt, buf, self._ex.submit(self.file.read, nxt, buf)))
                    nxt = _END
                if not pending:
                    return
                i, buf, fut = pending.popleft()
                try:
                    fut.result()
                except BaseException:
                    self.pool.release(buf)
                    raise
                self._held[id(buf)] = buf
                yield i, buf
        finally:
            for _, buf, fut in pending:
                cf.wait([fut])
                self.pool.release(buf)

    def buffer(self):
        """A buffer from the pool for a record filled from scratch (see write_new)."""
        return self.pool.acquire()

    def _reap(self) -> None:
        for i, fut in list(self._writes.items()):
            if fut.done():
                del self._writes[i]
                self._error = self._error or fut.exception()

    def _write_task(self, i: int, buf) -> None:
        try:
            self.file.write(i, buf)
        finally:
            self.pool.release(buf)

    def write(self, i: int, buf) -> None:
        """Queue buf to be written to record i; buf goes back to the pool once it is written."""
        self._held.pop(id(buf), None)
        if i in self._writes:  # two writes of one record on two threads could land in either order
            cf.wait([self._writes[i]])
        self._reap()
        if self._error is not None:
            self.pool.release(buf)
            raise self._error
        self._writes[i] = self._ex.submit(self._write_task, i, buf)

    write_new = write

    def release(self, buf) -> None:
        """Give back a yielded (or buffer()) buffer that is not to be written."""
        self._held.pop(id(buf), None)
        self.pool.release(buf)

    def drain(self) -> None:
        cf.wait(list(self._writes.values()))
        self._reap()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Wait for queued writes and stop the threads; drain(), not this, reports write errors. Buffers
        still out (reads ahead, a yielded one left by an exception) go back: the pool may outlive this."""
        for gen in list(self._readers):
            gen.close()
        self._ex.shutdown(wait=True)
        for buf in self._held.values():
            self.pool.release(buf)
        self._held.clear()


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(directory: str, name: str, step: int) -> None:
    tmp = os.path.join(directory, name + ".tmp")  # renamed into place: never a marker without its step
    with open(tmp, "w") as f:
        f.write(f"{int(step)}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, name))
    _fsync_dir(directory)


def _read_marker(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read()
        return int(text.strip())
    except FileNotFoundError:
        return None
    except ValueError:
        raise ValueError(f"{path}: expected a step number, found {text!r}") from None


def mark_dirty(directory: str, step: int) -> None:
    """Record that records are being rewritten for step `step`: the files mix two steps until commit()."""
    os.makedirs(directory, exist_ok=True)
    _write_marker(directory, "UPDATING", step)


def commit(directory: str, step: int) -> None:
    """Record atomically that the files hold the state after `step` updates, then clear UPDATING.
    Only after Streamer.drain() and RecordFile.flush()."""
    _write_marker(directory, "STEP", step)
    if os.path.exists(os.path.join(directory, "UPDATING")):
        os.unlink(os.path.join(directory, "UPDATING"))
        _fsync_dir(directory)


def file_state(directory: str) -> tuple[int | None, int | None]:
    """(committed step or None, step of an unfinished update or None). Both set and equal is a crash
    between commit()'s rename and its removal of UPDATING: the files hold that committed step."""
    return _read_marker(os.path.join(directory, "STEP")), _read_marker(os.path.join(directory, "UPDATING"))


def _copy_file(src: str, dst: str) -> None:
    size, off, chunk = os.stat(src).st_size, 0, None
    sfd = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    dfd = -1
    try:
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        while off < size:
            if chunk is None:
                try:  # a kernel-side copy: no user-space buffer at all
                    moved = os.copy_file_range(sfd, dfd, size - off, offset_src=off, offset_dst=off)
                except OSError as e:
                    if e.errno not in _NO_KERNEL_COPY:
                        raise
                    chunk = memoryview(bytearray(_COPY_CHUNK))  # bounded, whatever the file's size
                    continue
            else:
                moved = os.preadv(sfd, [chunk[:size - off]], off)
                done = 0
                while done < moved:
                    done += os.pwrite(dfd, chunk[done:moved], off + done)
            if moved == 0:
                raise OSError(errno.EIO, f"{src} ended at byte {off} of {size} while being copied")
            off += moved
        os.fsync(dfd)
        # nobody reads a copy soon: keep it from evicting the page cache's useful pages
        os.posix_fadvise(dfd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(sfd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(sfd)
        if dfd >= 0:
            os.close(dfd)


def _committed(directory: str, names: list[str]) -> list[str]:
    files = [*dict.fromkeys(n for n in names if n != "STEP"), "STEP"]  # STEP last: it vouches for the rest
    missing = [n for n in files if not os.path.isfile(os.path.join(directory, n))]
    if missing:
        raise ValueError(f"{directory}: not a committed state, missing {missing}")
    return files


def snapshot(source_dir: str, dest_dir: str, names: list[str], *, key: str) -> None:
    """Copy the named files and STEP of source_dir into a new directory dest_dir, atomically."""
    if os.path.exists(os.path.join(source_dir, "UPDATING")):
        raise ValueError(f"{source_dir}: an update is unfinished (UPDATING): its files mix two steps")
    if os.path.exists(dest_dir):  # a non-empty directory cannot be renamed over: fail before copying
        raise FileExistsError(errno.EEXIST, "snapshot destination exists", dest_dir)
    files = _committed(source_dir, names)
    tmp = dest_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crash; removed first so its space counts as free
    _check_free(key, dest_dir, sum(os.path.getsize(os.path.join(source_dir, n)) for n in files))
    try:
        os.makedirs(tmp)
        for n in files:
            _copy_file(os.path.join(source_dir, n), os.path.join(tmp, n))
        _fsync_dir(tmp)
        os.rename(tmp, dest_dir)
        _fsync_dir(os.path.dirname(os.path.abspath(dest_dir)))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def restore_snapshot(snapshot_dir: str, live_dir: str, names: list[str], *, key: str) -> None:
    """Copy the named files and STEP of a snapshot into live_dir. UPDATING is set first and removed
    last, so a crash midway leaves live_dir marked as mixed. RecordFiles open on live_dir still see the
    replaced files: reopen them after."""
    files = _committed(snapshot_dir, names)
    # an old file frees its space only once its copy replaces it: all the copies must fit beside them
    _check_free(key, live_dir, sum(os.path.getsize(os.path.join(snapshot_dir, n)) for n in files))
    mark_dirty(live_dir, _read_marker(os.path.join(snapshot_dir, "STEP")))
    try:
        for n in files:
            _copy_file(os.path.join(snapshot_dir, n), os.path.join(live_dir, n + ".tmp"))
            os.replace(os.path.join(live_dir, n + ".tmp"), os.path.join(live_dir, n))
    except BaseException:
        for n in files:
            if os.path.exists(os.path.join(live_dir, n + ".tmp")):
                os.unlink(os.path.join(live_dir, n + ".tmp"))
        raise
    _fsync_dir(live_dir)
    os.unlink(os.path.join(live_dir, "UPDATING"))
    _fsync_dir(live_dir)

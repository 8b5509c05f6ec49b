"""A plain numpy (float32) simulation of DeepSpeed's 1-bit Adam on N data-parallel workers.

This is the reference that the JAX implementation is tested against. Speed does not matter here (the
sizes are tiny); what matters is that every step can be read and checked against DeepSpeed:
`deepspeed/runtime/fp16/onebit/adam.py` (class `OnebitAdam`, method `step`) and
`deepspeed/runtime/comm/nccl.py` (`NcclBackend.compressed_allreduce`), microsoft/DeepSpeed at
38327e07f6cd (2025-02-21). Every worker is simulated with its own copies of the parameters, the
moments and the compression errors, and all arithmetic is float32.

The algorithm, per parameter tensor p (each tensor is its own buffer), steps t = 1, 2, ...:

  warm-up, t <= freeze_step (uncompressed):
      g  = mean over workers of the local gradients (sum in worker order, then times float32(1/N),
           like DeepSpeed's engine: all-reduce sum, then `mul_(1/dp_world_size)`)
      m  = b1*m + (1-b1)*g
      v  = b2*v + (1-b2)*(g*g)
  compressed phase, t > freeze_step (v frozen):
      m_k = b1*m + (1-b1)*g_k              (worker k's LOCAL gradient)
      m   = compressed_allreduce(m_0 .. m_{N-1})   (N > 1; with N == 1, m = m_0: no compression)
  both phases:
      update = m / (sqrt(v) + eps)         (no bias correction, eps outside the sqrt)
      update += weight_decay * p           (only if weight_decay > 0)
      p = p - lr * update

The scalar coefficients are rounded to float32 the way torch does it: `1 - b1` and `1 - b2` are
computed in double precision and then rounded (torch's `add_(1 - beta1, grad)`). Each elementwise
expression is evaluated left to right as written, rounding to float32 after every operation (no
fused multiply-add); torch's kernels may fuse or regroup some of them, a difference of an ulp.

compressed_allreduce (error feedback, two compressions), with a LAYOUT mapping a parameter-shaped
array to an (N, C) array of rows (row i is server i's chunk, C a multiple of 8) and back:

  worker k:  x_k = rows(m_k) + worker_error_k           (padding positions are zeros of rows(m_k))
             w_k = ||x_k||_2 / sqrt(N*C)
             worker_error_k = x_k - w_k * s(x_k)          s = sign with s(0) = +1
  server i:  a_i = sum_{k=0..N-1} s(x_k[i]) * (w_k * float32(1/N))   (sequential, from k = 0)
             a_i = a_i + server_error_i
             z_i = ||a_i||_2 / sqrt(C)
             server_error_i = a_i - z_i * s(a_i)
             row i of the result = z_i * s(a_i)
  every worker gathers all the result rows;  m = unrows(result)   (padding dropped)

Layouts (one per parameter):
  ("flat",)   DeepSpeed's: p flattened in C order, zero-padded at the end to a multiple of
              N * lcm(N, 8) (DeepSpeed's `size * divider`), reshaped to (N, C).
  ("zero", d) p zero-padded along dimension d to a multiple of N (zeroflax's stored leaf, when N does
              not divide it), split into N equal contiguous slices along d; row i is slice i flattened in
              C order, zero-padded at the end to C = the slice size rounded up to a multiple of 8.

Bit packing does not change any value, so signs are kept as float32 +-1 and never packed.

Public API: `simulate_onebit_adam` (the whole optimiser), `compressed_allreduce` (one call of the
compressed all-reduce; `compressed_allreduce_rows`, the same on (N, C) rows laid out already),
`to_rows` / `from_rows` / `row_width` (the layouts), `sign_pm1`, `norm_f32`.
Run this file to execute its self-check.
"""
from __future__ import annotations

import math

import numpy as np

F32 = np.float32

__all__ = [
    "simulate_onebit_adam",
    "compressed_allreduce",
    "compressed_allreduce_rows",
    "to_rows",
    "from_rows",
    "row_width",
    "sign_pm1",
    "norm_f32",
]


# ----------------------------------------------------------------------------------------------
# float32 primitives


def sign_pm1(x: np.ndarray) -> np.ndarray:
    """DeepSpeed's 1-bit sign, as float32 +-1: -1 where x < 0, +1 elsewhere (so s(0) = +1; also
    s(NaN) = +1, as in DeepSpeed's `x.sign().add_(1).bool()`)."""
    return np.where(x < 0, F32(-1.0), F32(1.0)).astype(F32)


def norm_f32(x: np.ndarray) -> np.float32:
    """The Euclidean norm of x, computed in float32 (float32 squares, float32 sum)."""
    x = np.asarray(x, dtype=F32)
    return F32(np.sqrt(np.sum(x * x, dtype=F32)))


# ----------------------------------------------------------------------------------------------
# layouts: parameter-shaped array <-> (N, C) rows


def _check_layout(shape: tuple, layout: tuple, n: int) -> None:
    if layout == ("flat",):
        return
    if len(layout) == 2 and layout[0] == "zero":
        d = layout[1]
        if not (isinstance(d, int) and -len(shape) <= d < len(shape)):
            raise ValueError(f"layout {layout}: no dimension {d} in shape {shape}")
        return
    raise ValueError(f"unknown layout {layout!r}: expected ('flat',) or ('zero', d)")


def row_width(shape: tuple, layout: tuple, n: int) -> int:
    """C, the width of one row (one server chunk) for a parameter of this shape, layout and N."""
    shape = tuple(shape)
    _check_layout(shape, layout, n)
    size = math.prod(shape)
    if layout == ("flat",):
        divider = n * 8 // math.gcd(n, 8)  # lcm(N, 8), DeepSpeed's `divider`
        unit = n * divider  # DeepSpeed pads the flat tensor to a multiple of size * divider
        corrected = -(-size // unit) * unit
        return corrected // n
    slice_size = math.prod(_padded(shape, layout[1], n)) // n
    return -(-slice_size // 8) * 8


def _padded(shape: tuple, d: int, n: int) -> tuple:
    """`shape` with dimension d rounded up to a multiple of n."""
    d = d % len(shape)
    return shape[:d] + (-(-shape[d] // n) * n,) + shape[d + 1:]


def to_rows(x: np.ndarray, layout: tuple, n: int) -> np.ndarray:
    """The (N, C) float32 rows of a parameter-shaped array x (padding positions are zeros)."""
    x = np.asarray(x, dtype=F32)
    c = row_width(x.shape, layout, n)
    rows = np.zeros((n, c), dtype=F32)
    if layout == ("flat",):
        flat = np.zeros(n * c, dtype=F32)
        flat[: x.size] = x.reshape(-1)
        return flat.reshape(n, c)
    d = layout[1] % x.ndim
    padded = np.zeros(_padded(x.shape, d, n), dtype=F32)
    padded[tuple(slice(0, k) for k in x.shape)] = x
    for i, piece in enumerate(np.split(padded, n, axis=d)):
        rows[i, : piece.size] = piece.reshape(-1)
    return rows


def from_rows(rows: np.ndarray, shape: tuple, layout: tuple, n: int) -> np.ndarray:
    """The inverse of `to_rows`: a float32 array of `shape` (the padding positions are dropped)."""
    shape = tuple(shape)
    c = row_width(shape, layout, n)
    rows = np.asarray(rows, dtype=F32)
    assert rows.shape == (n, c), (rows.shape, (n, c))
    size = math.prod(shape)
    if layout == ("flat",):
        return rows.reshape(-1)[:size].reshape(shape).copy()
    d = layout[1] % len(shape)
    padded = _padded(shape, d, n)
    slice_shape = padded[:d] + (padded[d] // n,) + padded[d + 1:]
    slice_size = math.prod(slice_shape)
    pieces = [rows[i, :slice_size].reshape(slice_shape) for i in range(n)]
    whole = np.concatenate(pieces, axis=d).astype(F32)
    return whole[tuple(slice(0, k) for k in shape)].copy()


# ----------------------------------------------------------------------------------------------
# the compressed all-reduce


def compressed_allreduce_rows(rows_workers, worker_errors, server_errors):
    """One compressed all-reduce of already laid-out rows over N workers (DeepSpeed's
    `NcclBackend.compressed_allreduce`, error feedback on both sides).

    rows_workers:  list of N float32 (N, C) arrays, worker k's buffer as rows (row i goes to server i).
    worker_errors: list of N float32 (N, C) arrays, worker k's worker error.
    server_errors: list of N float32 (C,) arrays, server i's (= worker i's) server error.

    Returns (result_rows, new_worker_errors, new_server_errors): result_rows is the (N, C) float32
    array that every worker gathers (the same on all workers). The inputs are not modified.
    """
    n = len(rows_workers)
    c = np.shape(rows_workers[0])[1]
    sqrt_nc = F32(np.sqrt(n * c))  # DeepSpeed: np.sqrt(buffer_m.numel()), numel = N*C
    sqrt_c = F32(np.sqrt(c))  # DeepSpeed: np.sqrt(compensated_server_m.numel())
    inv_n = F32(1.0 / n)  # DeepSpeed: `.mul_(1 / self.size)` on the gathered worker scales

    # worker side: compensate, compress, keep the compression error
    signs, scales, new_worker_errors = [], [], []
    for k in range(n):
        assert rows_workers[k].shape == (n, c) and rows_workers[k].dtype == F32
        assert worker_errors[k].shape == (n, c) and worker_errors[k].dtype == F32
        x = rows_workers[k] + worker_errors[k]
        w = F32(norm_f32(x) / sqrt_nc)
        s = sign_pm1(x)
        new_worker_errors.append((x - w * s).astype(F32))
        signs.append(s)  # row i of s goes to server i (all-to-all)
        scales.append(w)  # every scale goes to every server (all-gather)

    # server side: server i decompresses row i of every worker, compensates, compresses again
    result_rows, new_server_errors = [], []
    for i in range(n):
        assert server_errors[i].shape == (c,) and server_errors[i].dtype == F32
        a = signs[0][i] * F32(scales[0] * inv_n)
        for k in range(1, n):
            a = (a + signs[k][i] * F32(scales[k] * inv_n)).astype(F32)
        a = (a + server_errors[i]).astype(F32)
        z = F32(norm_f32(a) / sqrt_c)
        s = sign_pm1(a)
        new_server_errors.append((a - z * s).astype(F32))
        result_rows.append((z * s).astype(F32))  # all-gathered as (signs, scale)
    return np.stack(result_rows), new_worker_errors, new_server_errors


def compressed_allreduce(m_workers, worker_errors, server_errors, layout):
    """One compressed all-reduce of a parameter-shaped buffer over N workers: the buffers laid out as
    rows by `layout`, then `compressed_allreduce_rows`.

    m_workers:     list of N float32 arrays, worker k's buffer (its local momentum m_k).
    worker_errors: list of N float32 (N, C) arrays, worker k's worker error.
    server_errors: list of N float32 (C,) arrays, server i's (= worker i's) server error.
    layout:        ("flat",) or ("zero", d).

    Returns (results, new_worker_errors, new_server_errors): results is a list of N arrays of the
    buffer's shape, the result as each worker assembles it from the gathered rows (all equal).
    The inputs are not modified.
    """
    n = len(m_workers)
    shape = np.shape(m_workers[0])
    rows = [to_rows(m, layout, n) for m in m_workers]
    result_rows, new_worker_errors, new_server_errors = compressed_allreduce_rows(rows, worker_errors, server_errors)
    # every worker assembles the same rows
    results = [from_rows(result_rows, shape, layout, n) for _ in range(n)]
    return results, new_worker_errors, new_server_errors


# ----------------------------------------------------------------------------------------------
# the optimiser


def _clip_factor(grads, max_norm: float) -> np.float32:
    """optax.clip_by_global_norm's factor for the list `grads`."""
    norm = np.sqrt(sum(np.sum(g * g, dtype=F32) for g in grads), dtype=F32)
    return F32(1.0) if norm < max_norm else F32(max_norm / norm)


def _sketch(grads, buckets: int = 1024) -> np.ndarray:
    """zeroflax's count sketch, written again from its rule: element g of the list flattened in order goes
    into bucket g mod `buckets` with sign +1 or -1 by the top bit of
    g * 0x9E3779B1, xor-shifted right by 16, times 0x85EBCA6B (uint32)."""
    flat = np.concatenate([np.asarray(g, F32).reshape(-1) for g in grads])
    h = np.arange(flat.size, dtype=np.uint32) * np.uint32(0x9E3779B1)
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    signs = F32(1) - F32(2) * (h >> np.uint32(31)).astype(F32)
    out = np.zeros(buckets, F32)
    np.add.at(out, np.arange(flat.size) % buckets, (flat * signs).astype(F32))
    return out


def simulate_onebit_adam(params, grads, *, lr, b1, b2, eps, weight_decay, freeze_step, layouts,
                         n_workers=None, n_steps=None, grad_clip=0.0, local_clip=True):
    """Run 1-bit Adam on N simulated data-parallel workers and return the final parameters and state.

    params:  list of float32 numpy arrays (initial parameters, identical on all workers).
    grads:   either a callable (step: int starting at 1, worker: int) -> list of float32 arrays (that
             worker's local gradient for each parameter at that step), or a nested list
             grads[step-1][worker][param].
    lr, b1, b2, eps, weight_decay: Python floats (constant; rounded to float32 as torch does).
    freeze_step: the number of uncompressed warm-up steps (steps 1..freeze_step); from step
             freeze_step+1 on, v is frozen and the momentum goes through the compressed all-reduce.
    layouts: list (one per param) of ("flat",) or ("zero", d).
    n_workers: N. Taken from the list (len(grads[0])); required with a callable.
    n_steps: the number of steps. Taken from the list (len(grads)); required with a callable.
    grad_clip: > 0 clips the mean gradient during warm-up (as DeepSpeed's fp32 engine does); in the
             compressed phase, with local_clip (DeepSpeed's rule) each worker's local gradient by its own
             global L2 norm, without it every worker's by the factor for the norm that the mean of the
             workers' sketches (`_sketch`) estimates for the mean gradient (zeroflax's default).

    Returns (final_params, state): final_params is a list of float32 arrays (checked to be identical on
    all workers); state is a dict with, per parameter (lists in parameter order):
      "m", "v":          float32 arrays of the parameter's shape (identical on all workers);
      "worker_errors":   float32 (N, N, C): [k] is worker k's (N, C) worker error;
      "server_errors":   float32 (N, C):    [i] is server i's (C,) server error;
    and "step": the number of steps taken. The errors are zeros when no compressed step ran, and
    always with N == 1 (no compression then, as in DeepSpeed).
    """
    params = [np.asarray(p, dtype=F32) for p in params]
    n_params = len(params)
    if len(layouts) != n_params:
        raise ValueError(f"{len(layouts)} layouts for {n_params} params")
    if callable(grads):
        if n_workers is None or n_steps is None:
            raise ValueError("pass n_workers= and n_steps= with a callable grads")
        n, t_max = int(n_workers), int(n_steps)
        grad_fn = grads
    else:
        t_max = len(grads) if n_steps is None else int(n_steps)
        n = len(grads[0])
        if n_workers is not None and n_workers != n:
            raise ValueError(f"n_workers={n_workers} but the gradient list has {n} workers")
        grad_fn = lambda step, worker: grads[step - 1][worker]  # noqa: E731
    if n < 1:
        raise ValueError("need at least one worker")

    b1_, b2_ = F32(b1), F32(b2)
    one_minus_b1, one_minus_b2 = F32(1.0 - b1), F32(1.0 - b2)  # torch: add_(1 - beta1, grad)
    eps_, wd_, lr_ = F32(eps), F32(weight_decay), F32(lr)
    inv_n = F32(1.0 / n)  # the engine's all-reduce: sum, then mul_(1 / dp_world_size)

    widths = [row_width(p.shape, lay, n) for p, lay in zip(params, layouts)]
    # every worker's own copy of everything
    p_w = [[p.copy() for p in params] for _ in range(n)]
    m_w = [[np.zeros_like(p) for p in params] for _ in range(n)]
    v_w = [[np.zeros_like(p) for p in params] for _ in range(n)]
    werr = [[np.zeros((n, c), F32) for c in widths] for _ in range(n)]  # werr[k][j]: worker k, param j
    serr = [[np.zeros((c,), F32) for c in widths] for _ in range(n)]  # serr[i][j]: server i, param j

    for t in range(1, t_max + 1):
        g_w = []
        for k in range(n):
            gk = [np.asarray(g, dtype=F32) for g in grad_fn(t, k)]
            if len(gk) != n_params or any(g.shape != p.shape for g, p in zip(gk, params)):
                raise ValueError(f"step {t}, worker {k}: gradient shapes do not match the params")
            g_w.append(gk)

        # the engine all-reduces the gradients during warm-up: sum over workers, then times 1/N
        g_means = []
        for j in range(n_params):
            total = g_w[0][j].copy()
            for k in range(1, n):
                total = (total + g_w[k][j]).astype(F32)
            g_means.append((total * inv_n).astype(F32))
        if grad_clip > 0:  # DeepSpeed's fp32 engine clips what the optimizer gets: the mean, then the local gradient
            clip = lambda gs: [(g * _clip_factor(gs, grad_clip)).astype(F32) for g in gs]  # noqa: E731
            if t <= freeze_step:
                g_means = clip(g_means)
            elif local_clip:
                g_w = [clip(gk) for gk in g_w]
            else:
                sketch = (sum(_sketch(gk) for gk in g_w) * inv_n).astype(F32)
                estimate = np.sqrt(np.sum(sketch * sketch, dtype=F32), dtype=F32)
                factor = F32(1.0) if estimate < grad_clip else F32(grad_clip / estimate)
                g_w = [[(g * factor).astype(F32) for g in gk] for gk in g_w]

        for j in range(n_params):
            if t <= freeze_step:
                g_mean = g_means[j]
                for k in range(n):
                    m_w[k][j] = (b1_ * m_w[k][j] + one_minus_b1 * g_mean).astype(F32)
                    v_w[k][j] = (b2_ * v_w[k][j] + one_minus_b2 * (g_mean * g_mean)).astype(F32)
            else:
                local = [(b1_ * m_w[k][j] + one_minus_b1 * g_w[k][j]).astype(F32) for k in range(n)]
                if n > 1:
                    results, new_we, new_se = compressed_allreduce(
                        local, [werr[k][j] for k in range(n)], [serr[i][j] for i in range(n)], layouts[j])
                    for k in range(n):
                        m_w[k][j] = results[k]
                        werr[k][j] = new_we[k]
                        serr[k][j] = new_se[k]
                else:
                    m_w[0][j] = local[0]  # DeepSpeed: `if self.size > 1:` around the compression

            for k in range(n):
                update = (m_w[k][j] / (np.sqrt(v_w[k][j]) + eps_)).astype(F32)
                if weight_decay > 0.0:
                    update = (update + wd_ * p_w[k][j]).astype(F32)
                p_w[k][j] = (p_w[k][j] - lr_ * update).astype(F32)

    for k in range(1, n):
        for j in range(n_params):
            assert np.array_equal(p_w[k][j], p_w[0][j]), f"worker {k} param {j} differs from worker 0"
            assert np.array_equal(m_w[k][j], m_w[0][j]), f"worker {k} m {j} differs from worker 0"
            assert np.array_equal(v_w[k][j], v_w[0][j]), f"worker {k} v {j} differs from worker 0"

    state = {
        "m": [m.copy() for m in m_w[0]],
        "v": [v.copy() for v in v_w[0]],
        "worker_errors": [np.stack([werr[k][j] for k in range(n)]) for j in range(n_params)],
        "server_errors": [np.stack([serr[i][j] for i in range(n)]) for j in range(n_params)],
        "step": t_max,
    }
    return [p.copy() for p in p_w[0]], state


# ----------------------------------------------------------------------------------------------
# self-check


def _plain_adam_frozen_v(params, grads_of_worker0, *, lr, b1, b2, eps, weight_decay, freeze_step, n_steps):
    """Adam without bias correction whose v freezes after freeze_step: what 1-bit Adam is with N == 1."""
    ps = [np.asarray(p, F32).copy() for p in params]
    ms = [np.zeros_like(p) for p in ps]
    vs = [np.zeros_like(p) for p in ps]
    for t in range(1, n_steps + 1):
        for j, g in enumerate(grads_of_worker0(t)):
            g = np.asarray(g, F32)
            ms[j] = (F32(b1) * ms[j] + F32(1.0 - b1) * g).astype(F32)
            if t <= freeze_step:
                vs[j] = (F32(b2) * vs[j] + F32(1.0 - b2) * (g * g)).astype(F32)
            upd = (ms[j] / (np.sqrt(vs[j]) + F32(eps))).astype(F32)
            if weight_decay > 0:
                upd = (upd + F32(weight_decay) * ps[j]).astype(F32)
            ps[j] = (ps[j] - F32(lr) * upd).astype(F32)
    return ps


def _self_check() -> None:
    rng = np.random.default_rng(0)
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, freeze_step=2)
    n, n_steps = 4, 6
    shapes = [(13,), (6, 5)]
    params = [rng.standard_normal(s).astype(F32) for s in shapes]
    grads = [[[rng.standard_normal(s).astype(F32) for s in shapes] for _ in range(n)] for _ in range(n_steps)]

    # layouts and their round trip
    assert row_width((13,), ("flat",), 4) == 8 and row_width((30,), ("flat",), 4) == 8
    assert row_width((13,), ("flat",), 3) == 24  # padded to a multiple of 3 * lcm(3, 8) = 72
    assert row_width((6, 8), ("zero", 1), 4) == 16 and row_width((12,), ("zero", 0), 4) == 8
    for shape, lay, nn in [((13,), ("flat",), 4), ((6, 5), ("flat",), 3), ((6, 8), ("zero", 1), 4),
                           ((8, 3), ("zero", 0), 4), ((2, 6, 3), ("zero", -2), 3)]:
        x = rng.standard_normal(shape).astype(F32)
        rows = to_rows(x, lay, nn)
        assert np.array_equal(from_rows(rows, shape, lay, nn), x)
        assert np.count_nonzero(rows) == x.size  # padding is zeros
    x = np.arange(24, dtype=F32).reshape(4, 6)
    assert np.array_equal(to_rows(x, ("zero", 1), 2)[1, :12], x[:, 3:].reshape(-1))

    # one compressed all-reduce against DeepSpeed's own reference formulation (its
    # tests/onebit/test_nccl_backend.py, `torch_sim`): average of the worker-compressed buffers,
    # then each server chunk compressed with its own scale (zero errors to start with)
    ms = [rng.standard_normal((6, 5)).astype(F32) for _ in range(n)]
    c = row_width((6, 5), ("flat",), n)
    res, we, se = compressed_allreduce(ms, [np.zeros((n, c), F32)] * n, [np.zeros(c, F32)] * n, ("flat",))
    comp = [np.linalg.norm(to_rows(m, ("flat",), n)) / np.sqrt(n * c) * sign_pm1(to_rows(m, ("flat",), n))
            for m in ms]
    avg = sum(comp) / n
    ref_rows = np.stack([np.linalg.norm(avg[i]) / np.sqrt(c) * sign_pm1(avg[i]) for i in range(n)])
    assert np.allclose(res[0], from_rows(ref_rows, (6, 5), ("flat",), n), atol=1e-6)
    assert all(np.array_equal(r, res[0]) for r in res)
    # error feedback bookkeeping: mean(x_k) = result + mean(new worker errors) + new server error - old
    # (all zeros here); every worker error row of a padded position is the worker's -w_k * s(0) = -w_k
    lhs = sum(to_rows(m, ("flat",), n) for m in ms) / n
    rhs = to_rows(res[0], ("flat",), n) + sum(we) / n + np.stack(se)
    rhs.reshape(-1)[30:] = lhs.reshape(-1)[30:]  # the result's padding positions are dropped
    assert np.allclose(lhs, rhs, atol=1e-6)

    # the whole optimiser, N = 4
    final, state = simulate_onebit_adam(params, grads, layouts=[("flat",), ("flat",)], **hp)
    np.set_printoptions(precision=6, suppress=True, linewidth=120)
    print("N=4, flat layouts, 6 steps, freeze_step=2")
    for j, p in enumerate(final):
        print(f"  param {j} {p.shape}:\n{p}")
        print(f"  |worker errors| {np.abs(state['worker_errors'][j]).max():.6f}"
              f"  |server errors| {np.abs(state['server_errors'][j]).max():.6f}")
    assert all(p.dtype == F32 for p in final)
    assert all(np.abs(e).max() > 0 for e in state["worker_errors"] + state["server_errors"])

    # the same with the ZeRO layouts (and a callable grads)
    zshapes = [(12,), (6, 8)]
    zparams = [rng.standard_normal(s).astype(F32) for s in zshapes]
    zgrads = [[[rng.standard_normal(s).astype(F32) for s in zshapes] for _ in range(n)] for _ in range(n_steps)]
    zfinal, zstate = simulate_onebit_adam(zparams, lambda t, k: zgrads[t - 1][k], n_workers=n, n_steps=n_steps,
                                          layouts=[("zero", 0), ("zero", 1)], **hp)
    assert zstate["worker_errors"][1].shape == (n, n, 16) and zstate["server_errors"][1].shape == (n, 16)
    print("N=4, ZeRO layouts: param 1 row 0:", zfinal[1][0])

    # warm-up only: identical to uncompressed Adam on the mean gradient
    wfinal, wstate = simulate_onebit_adam(params, grads, layouts=[("flat",), ("flat",)],
                                          **{**hp, "freeze_step": n_steps})
    mean_grad = lambda t: [sum(grads[t - 1][k][j] for k in range(n)) * F32(1 / n) for j in range(2)]  # noqa: E731
    ref = _plain_adam_frozen_v(params, mean_grad, n_steps=n_steps, **hp | {"freeze_step": n_steps})
    assert all(np.array_equal(a, b) for a, b in zip(wfinal, ref))
    assert all(not e.any() for e in wstate["worker_errors"] + wstate["server_errors"])

    # N = 1: no compression at all, so plain Adam without bias correction with v frozen after freeze_step
    grads1 = [[g[0]] for g in grads]
    final1, state1 = simulate_onebit_adam(params, grads1, layouts=[("flat",), ("flat",)], **hp)
    ref1 = _plain_adam_frozen_v(params, lambda t: grads1[t - 1][0], n_steps=n_steps, **hp)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(final1, ref1))
    print(f"N=1 against plain Adam (no bias correction, v frozen after step 2): max |diff| = {diff}")
    assert diff == 0.0
    assert all(not e.any() for e in state1["worker_errors"] + state1["server_errors"])
    print("self-check passed")


if __name__ == "__main__":
    _self_check()

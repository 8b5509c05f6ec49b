"""A plain numpy (float32) simulation of DeepSpeed's 1-bit LAMB on N data-parallel workers.

The reference that zeroflax's 1-bit LAMB is tested against, built on onebit_sim.py (its compressed
all-reduce, layouts and float32 conventions: every operation rounded to float32, torch's `1 - b1`
rounded from double, expressions evaluated left to right, sums over workers in worker order). Read
against DeepSpeed's `deepspeed/runtime/fp16/onebit/lamb.py` (class `OnebitLamb`, method `step`),
deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641. Every worker keeps its own
copy of the parameters and the whole state; they are checked to agree at the end.

Steps t = 1, 2, ... are all real (zeroflax's convention; DeepSpeed's first `step` call only
initialises, so DeepSpeed's own step counter is t + 1). Per parameter tensor p:

  warm-up, t <= freeze_step (uncompressed; g = mean of the local gradients, summed in worker order,
  times float32(1/N)):
      m = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*(g*g);   if t == freeze_step: v_fresh = v
      update = m / (sqrt(v) + eps)  (+ weight_decay*p if weight_decay > 0)
      coeff = 1;  if ||p|| != 0 and ||update|| != 0: coeff = clip(||p|| / ||update||, min_coeff, max_coeff)
      if coeff != 1: coeff_freeze = coeff_beta*coeff_freeze + (1-coeff_beta)*coeff
      p = p + (-lr*coeff) * update           (the scalar first, as DeepSpeed's `-lr * lamb_coeff * update`)
  first compressed step (t == freeze_step + 1), per param j:
      scale_j = ||m_j|| / sqrt(numel_j);  united = (sum_j scale_j) / n_params;  scaling_coeff_j = united / scale_j
  compressed step, t > freeze_step (v frozen):
      m_last = m
      worker k: m_k = (b1*m + (1-b1)*g_k) * scaling_coeff_j          (g_k its LOCAL gradient)
      all params' m_k as ONE united buffer through compressed_allreduce_rows (N > 1; N == 1: m = m_0)
      m = result / scaling_coeff_j
      g_rec = (m - m_last*b1) / (1-b1);   v_fresh = b2*v_fresh + (1-b2)*(g_rec*g_rec)
      denom = sqrt(v) + eps;  prelim = m / denom;  update = prelim (+ weight_decay*p)
      factor = max(denom / (sqrt(v_fresh) + eps))
      if weight_decay > 0: ratio = min(1, ||prelim|| / ||update||);  factor = factor*ratio + (1-ratio)
      factor: clipped to [factor_min, factor_max], then to last_factor*[1-threshold, 1+threshold]
              (each bound tested in DeepSpeed's order: max, min, upper threshold, lower threshold)
      last_factor = factor;  coeff = coeff_freeze * factor;  p = p + (-lr*coeff) * update

The united buffer (`united_rows`): DeepSpeed flattens all momenta, in param order, into one buffer
zero-padded to a multiple of N * lcm(N, 8). Here the rows (N, C) are the hstack of segment 0, the
"flat" params so flattened, concatenated and padded, reshaped (N, C0) (absent if none is "flat"),
then for each ("zero", d) param in param order its `to_rows(m_j, ("zero", d), N)`.

Differences from DeepSpeed, by name:
  * the first call is a real step (above); DeepSpeed's warm-up has freeze_step - 1 real steps, since its
    counter, which the `== freeze_step` / `>= freeze_step` tests read, counts the initialising call;
  * scalars: DeepSpeed reads the norms' ratio, max(denom/denom_real) and the decay ratio with `.item()`
    and does the clipping, coeff_freeze, factor, thresholds, the scales' mean and scaling_coeff in Python
    doubles; here all are float32 (as a JAX implementation holds them): float32 divisions, the
    hyper-parameters as float32(x), (1 - coeff_beta) and (1 +- threshold) rounded from double like
    (1 - b1), the mean of the scales their float32 sum in param order over float32(n_params);
  * freeze_step == 0: the momentum at the first compressed step is zeros, every scale is 0, and
    scaling_coeff is 1 where a param's scale is 0 (DeepSpeed divides by zero). Also, whatever
    freeze_step, coeff_freeze starts at 0 (as DeepSpeed's), so with freeze_step == 0 nothing moves;
  * weight_decay > 0 and ||update|| == 0: the ratio 0/0 is NaN, and Python's min(1.0, nan) is 1.0 in
    DeepSpeed; here likewise ratio = 1 unless ||prelim||/||update|| < 1;
  * no exp_avg_mask, one param group, constant lr, no bias correction (DeepSpeed's OnebitLamb has none).

Public API: `simulate_onebit_lamb`, `united_rows`, `from_united_rows`, `united_width`.
Run this file to execute its self-check.
"""
from __future__ import annotations

import math

import numpy as np

from onebit_sim import F32, compressed_allreduce_rows, from_rows, norm_f32, row_width, to_rows

__all__ = ["simulate_onebit_lamb", "united_rows", "from_united_rows", "united_width"]


# ----------------------------------------------------------------------------------------------
# the united buffer: all params' momenta as one (N, C) array of rows


def _segments(shapes, layouts, n):
    """[(kind, param indices, width)]: segment 0 (the flat params, if any), then one per "zero" param."""
    if len(shapes) != len(layouts):
        raise ValueError(f"{len(layouts)} layouts for {len(shapes)} params")
    flat = [j for j, lay in enumerate(layouts) if tuple(lay) == ("flat",)]
    total = sum(math.prod(shapes[j]) for j in flat)
    segs = [("flat", flat, row_width((total,), ("flat",), n))] if flat else []
    return segs + [("zero", [j], row_width(tuple(shapes[j]), tuple(lay), n))
                   for j, lay in enumerate(layouts) if tuple(lay) != ("flat",)]


def united_width(shapes, layouts, n: int) -> int:
    """C of the united rows for params of these shapes and layouts on N workers."""
    return sum(w for _, _, w in _segments([tuple(s) for s in shapes], layouts, n))


def united_rows(arrays, layouts, n: int) -> np.ndarray:
    """The (N, C) float32 united rows of a list of param-shaped arrays (padding positions are zeros)."""
    arrays = [np.asarray(a, dtype=F32) for a in arrays]
    parts = []
    for kind, idx, _ in _segments([a.shape for a in arrays], layouts, n):
        if kind == "flat":
            parts.append(to_rows(np.concatenate([arrays[j].reshape(-1) for j in idx]), ("flat",), n))
        else:
            parts.append(to_rows(arrays[idx[0]], tuple(layouts[idx[0]]), n))
    return np.hstack(parts).astype(F32)


def from_united_rows(rows, shapes, layouts, n: int) -> list:
    """The inverse of `united_rows`: a list of float32 arrays of `shapes` (padding dropped)."""
    shapes = [tuple(s) for s in shapes]
    rows, segs = np.asarray(rows, dtype=F32), _segments(shapes, layouts, n)
    assert rows.shape == (n, sum(w for _, _, w in segs)), rows.shape
    out, col = [None] * len(shapes), 0
    for kind, idx, width in segs:
        block = rows[:, col:col + width]
        col += width
        if kind == "flat":
            ends = np.cumsum([math.prod(shapes[j]) for j in idx])
            for j, piece in zip(idx, np.split(block.reshape(-1)[: ends[-1]], ends[:-1])):
                out[j] = piece.reshape(shapes[j]).copy()
        else:
            out[idx[0]] = from_rows(block, shapes[idx[0]], tuple(layouts[idx[0]]), n)
    return out


# ----------------------------------------------------------------------------------------------
# the optimiser


def _grad_source(grads, shapes, n_workers, n_steps):
    """(N, n_steps, local_grads): local_grads(t) is the list over workers of their float32 gradient lists.
    grads is a callable (step from 1, worker) -> list, or a nested list grads[step-1][worker][param]."""
    if callable(grads):
        if n_workers is None or n_steps is None:
            raise ValueError("pass n_workers= and n_steps= with a callable grads")
        n, t_max, fn = int(n_workers), int(n_steps), grads
    else:
        t_max, n = (len(grads) if n_steps is None else int(n_steps)), len(grads[0])
        if n_workers is not None and n_workers != n:
            raise ValueError(f"n_workers={n_workers} but the gradient list has {n} workers")
        fn = lambda step, worker: grads[step - 1][worker]  # noqa: E731
    if n < 1:
        raise ValueError("need at least one worker")

    def local_grads(t):
        out = [[np.asarray(g, dtype=F32) for g in fn(t, k)] for k in range(n)]
        if any(len(gk) != len(shapes) or any(g.shape != tuple(s) for g, s in zip(gk, shapes)) for gk in out):
            raise ValueError(f"step {t}: gradient shapes do not match the params")
        return out
    return n, t_max, local_grads


def _mean_grads(g_w):
    """The engine's all-reduced gradient: the sum over workers in worker order, times float32(1/N)."""
    totals = [g.copy() for g in g_w[0]]
    for gk in g_w[1:]:
        totals = [(a + g).astype(F32) for a, g in zip(totals, gk)]
    return [(a * F32(1.0 / len(g_w))).astype(F32) for a in totals]


def _clamp_factor(factor, last, fmin, fmax, up, down):
    """DeepSpeed's four clamps of the factor, in its order; returns (factor, which clamp bit last)."""
    hit = "none"
    if factor > fmax:
        factor, hit = fmax, "max"
    if factor < fmin:
        factor, hit = fmin, "min"
    hi, lo = F32(last * up), F32(last * down)
    if factor > hi:
        factor, hit = hi, "threshold_up"
    if factor < lo:
        factor, hit = lo, "threshold_down"
    return F32(factor), hit


def simulate_onebit_lamb(params, grads, *, lr, b1, b2, eps, weight_decay, freeze_step, layouts, max_coeff=10.0,
                         min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, factor_threshold=0.1,
                         n_workers=None, n_steps=None):
    """Run 1-bit LAMB on N simulated workers (module docstring) and return (final_params, state).

    params: list of float32 arrays; grads: a callable (step from 1, worker) -> list of that worker's
    local gradients, or a nested list grads[step-1][worker][param] (n_workers / n_steps then default to
    its lengths; a callable needs both). layouts: per param ("flat",) or ("zero", d) (the united buffer).

    state: per param lists "m", "v", "v_fresh" (float32 arrays), "coeff_freeze", "last_factor",
    "scaling_coeff" (float32 scalars; scaling_coeff 1 before the compressed phase); "worker_errors"
    (N, N, C) and "server_errors" (N, C) of the united buffer; "factor_clamps": per compressed step, per
    param, which clamp of the factor bit last ("none", "max", "min", "threshold_up", "threshold_down");
    "lamb_coeffs": per step, per param, the coefficient used; "step".
    """
    params = [np.asarray(p, dtype=F32) for p in params]
    n_params, shapes = len(params), [p.shape for p in params]
    n, t_max, local_grads = _grad_source(grads, shapes, n_workers, n_steps)

    b1_, b2_, eps_, wd_, lr_ = F32(b1), F32(b2), F32(eps), F32(weight_decay), F32(lr)
    omb1, omb2 = F32(1.0 - b1), F32(1.0 - b2)
    cmax, cmin, cb_, omcb = F32(max_coeff), F32(min_coeff), F32(coeff_beta), F32(1.0 - coeff_beta)
    fmax, fmin, up, down = F32(factor_max), F32(factor_min), F32(1.0 + factor_threshold), F32(1.0 - factor_threshold)
    sqrt_numel = [F32(np.sqrt(p.size)) for p in params]
    width = united_width(shapes, layouts, n)

    zeros = lambda: [np.zeros_like(p) for p in params]  # noqa: E731
    # every worker's own copy of everything
    w = [dict(p=[p.copy() for p in params], m=zeros(), v=zeros(), vf=zeros(), cf=[F32(0)] * n_params,
              lf=[F32(1)] * n_params, sc=[F32(1)] * n_params) for _ in range(n)]
    werr = [np.zeros((n, width), F32) for _ in range(n)]
    serr = [np.zeros((width,), F32) for _ in range(n)]
    clamps_log, coeff_log = [], []

    for t in range(1, t_max + 1):
        g_w = local_grads(t)
        if t <= freeze_step:  # warm-up: uncompressed LAMB on the mean gradient
            g_mean = _mean_grads(g_w)
            for k, s in enumerate(w):
                coeffs = []
                for j in range(n_params):
                    g = g_mean[j]
                    s["m"][j] = (b1_ * s["m"][j] + omb1 * g).astype(F32)
                    s["v"][j] = (b2_ * s["v"][j] + omb2 * (g * g)).astype(F32)
                    if t == freeze_step:
                        s["vf"][j] = s["v"][j].copy()
                    update = (s["m"][j] / (np.sqrt(s["v"][j]) + eps_)).astype(F32)
                    if weight_decay > 0.0:
                        update = (update + wd_ * s["p"][j]).astype(F32)
                    wn, un = norm_f32(s["p"][j]), norm_f32(update)
                    coeff = F32(1.0)
                    if wn != 0 and un != 0:
                        coeff = F32(wn / un)
                        coeff = cmax if coeff > cmax else coeff
                        coeff = cmin if coeff < cmin else coeff
                    if coeff != F32(1.0):
                        s["cf"][j] = F32(F32(cb_ * s["cf"][j]) + F32(omcb * coeff))
                    s["p"][j] = (s["p"][j] + F32(-lr_ * coeff) * update).astype(F32)
                    coeffs.append(coeff)
                if k == 0:
                    coeff_log.append(coeffs)
            continue

        # compressed phase
        if t == freeze_step + 1:  # the scaling coefficients, from the momentum at the end of warm-up
            for s in w:
                scales = [F32(norm_f32(s["m"][j]) / sqrt_numel[j]) for j in range(n_params)]
                total = F32(0)
                for x in scales:
                    total = F32(total + x)
                united = F32(total / F32(n_params))
                s["sc"] = [F32(united / x) if x != 0 else F32(1.0) for x in scales]
        local = []
        for k, s in enumerate(w):
            s["m_last"] = [m.copy() for m in s["m"]]
            local.append([((b1_ * s["m"][j] + omb1 * g_w[k][j]) * s["sc"][j]).astype(F32) for j in range(n_params)])
        if n > 1:
            result, werr, serr = compressed_allreduce_rows([united_rows(mk, layouts, n) for mk in local], werr, serr)
            moms = [from_united_rows(result, shapes, layouts, n) for _ in range(n)]
        else:
            moms = local  # DeepSpeed: `if self.size > 1:` around the compression
        for k, s in enumerate(w):
            clamps, coeffs = [], []
            for j in range(n_params):
                m = (moms[k][j] / s["sc"][j]).astype(F32)
                s["m"][j] = m
                g_rec = ((m - s["m_last"][j] * b1_) / omb1).astype(F32)
                s["vf"][j] = (b2_ * s["vf"][j] + omb2 * (g_rec * g_rec)).astype(F32)
                denom = (np.sqrt(s["v"][j]) + eps_).astype(F32)
                prelim = (m / denom).astype(F32)
                update = (prelim + wd_ * s["p"][j]).astype(F32) if weight_decay > 0.0 else prelim
                denom_real = (np.sqrt(s["vf"][j]) + eps_).astype(F32)
                factor = F32(np.max((denom / denom_real).astype(F32)))
                if weight_decay > 0.0:
                    ratio = F32(norm_f32(prelim) / norm_f32(update))
                    ratio = ratio if ratio < F32(1.0) else F32(1.0)  # Python's min(1.0, nan) is 1.0
                    factor = F32(F32(factor * ratio) + F32(F32(1.0) - ratio))
                factor, hit = _clamp_factor(factor, s["lf"][j], fmin, fmax, up, down)
                s["lf"][j] = factor
                coeff = F32(s["cf"][j] * factor)
                s["p"][j] = (s["p"][j] + F32(-lr_ * coeff) * update).astype(F32)
                clamps.append(hit)
                coeffs.append(coeff)
            if k == 0:
                clamps_log.append(clamps)
                coeff_log.append(coeffs)

    for k in range(1, n):
        for key in ("p", "m", "v", "vf"):
            for j in range(n_params):
                assert np.array_equal(w[k][key][j], w[0][key][j]), f"worker {k}: {key}[{j}] differs from worker 0"
        for key in ("cf", "lf", "sc"):
            assert w[k][key] == w[0][key], f"worker {k}: {key} differs from worker 0"

    s = w[0]
    state = {
        "m": [m.copy() for m in s["m"]], "v": [v.copy() for v in s["v"]], "v_fresh": [v.copy() for v in s["vf"]],
        "coeff_freeze": list(s["cf"]), "last_factor": list(s["lf"]), "scaling_coeff": list(s["sc"]),
        "worker_errors": np.stack(werr), "server_errors": np.stack(serr),
        "factor_clamps": clamps_log, "lamb_coeffs": coeff_log, "step": t_max,
    }
    return [p.copy() for p in s["p"]], state


# ----------------------------------------------------------------------------------------------
# self-check


def _plain_lamb_with_freezing(params, grad_of, *, lr, b1, b2, eps, weight_decay, freeze_step, n_steps,
                              max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                              factor_threshold=0.1):
    """One worker's 1-bit LAMB written straight from the module docstring, param by param, with no
    buffer and no compression (the momentum still scaled and unscaled, as DeepSpeed does with N == 1)."""
    f = F32
    ps = [np.asarray(p, f).copy() for p in params]
    ms, vs, vfs = ([np.zeros_like(p) for p in ps] for _ in range(3))
    cfs, lfs, scs = [f(0)] * len(ps), [f(1)] * len(ps), [f(1)] * len(ps)
    for t in range(1, n_steps + 1):
        if t == freeze_step + 1:
            scales = [f(norm_f32(m) / f(np.sqrt(m.size))) for m in ms]
            mean = f(f(sum(scales, f(0))) / f(len(scales)))
            scs = [f(mean / x) if x != 0 else f(1) for x in scales]
        for j, g in enumerate(grad_of(t)):
            g, p, m, v, vf = np.asarray(g, f), ps[j], ms[j], vs[j], vfs[j]
            if t <= freeze_step:
                m = (f(b1) * m + f(1 - b1) * g).astype(f)
                v = (f(b2) * v + f(1 - b2) * (g * g)).astype(f)
                vf = v.copy() if t == freeze_step else vf
                u = (m / (np.sqrt(v) + f(eps))).astype(f)
                u = (u + f(weight_decay) * p).astype(f) if weight_decay > 0 else u
                c = f(1)
                if norm_f32(p) != 0 and norm_f32(u) != 0:
                    c = f(np.clip(f(norm_f32(p) / norm_f32(u)), f(min_coeff), f(max_coeff)))
                if c != 1:
                    cfs[j] = f(f(f(coeff_beta) * cfs[j]) + f(f(1 - coeff_beta) * c))
            else:
                last = m
                m = ((((f(b1) * m + f(1 - b1) * g) * scs[j]).astype(f)) / scs[j]).astype(f)
                r = ((m - last * f(b1)) / f(1 - b1)).astype(f)
                vf = (f(b2) * vf + f(1 - b2) * (r * r)).astype(f)
                d = (np.sqrt(v) + f(eps)).astype(f)
                pre = (m / d).astype(f)
                u = (pre + f(weight_decay) * p).astype(f) if weight_decay > 0 else pre
                fac = f(np.max((d / (np.sqrt(vf) + f(eps))).astype(f)))
                if weight_decay > 0:
                    ratio = min(f(1), f(norm_f32(pre) / norm_f32(u)))
                    fac = f(f(fac * ratio) + f(f(1) - ratio))
                fac = f(min(max(fac, f(factor_min)), f(factor_max)))
                fac = f(min(max(fac, f(lfs[j] * f(1 - factor_threshold))), f(lfs[j] * f(1 + factor_threshold))))
                lfs[j] = fac
                c = f(cfs[j] * fac)
            ps[j], ms[j], vs[j], vfs[j] = (p + f(-f(lr) * c) * u).astype(f), m, v, vf
    return ps


def _self_check() -> None:
    rng = np.random.default_rng(1)
    # the united layout and its round trip; all "flat" is DeepSpeed's single flat buffer
    for shapes, lays, n in [([(13,), (6, 5)], [("flat",), ("flat",)], 4),
                            ([(7,), (6, 8), (3, 3), (12,)], [("flat",), ("zero", 1), ("flat",), ("zero", 0)], 4),
                            ([(6, 8), (5,)], [("zero", 0), ("zero", 0)], 3), ([(9,)], [("flat",)], 1)]:
        xs = [rng.standard_normal(s).astype(F32) for s in shapes]
        rows = united_rows(xs, lays, n)
        assert rows.shape == (n, united_width(shapes, lays, n)) and np.count_nonzero(rows) == sum(x.size for x in xs)
        assert all(np.array_equal(a, b) for a, b in zip(from_united_rows(rows, shapes, lays, n), xs))
        if all(lay == ("flat",) for lay in lays):
            flat = np.concatenate([x.reshape(-1) for x in xs])
            assert np.array_equal(rows, to_rows(flat, ("flat",), n))
    assert united_width([(13,), (6, 5)], [("flat",)] * 2, 4) == 16  # 43 -> 64 = 2 * (4 * lcm(4, 8))

    shapes = [(13,), (6, 8), (4, 4)]
    params = [rng.standard_normal(s).astype(F32) for s in shapes]
    n, n_steps = 4, 12
    drift = [rng.standard_normal(s).astype(F32) for s in shapes]
    grads = [[[(drift[j] + F32(0.5) * rng.standard_normal(s)).astype(F32) for j, s in enumerate(shapes)]
              for _ in range(n)] for _ in range(n_steps)]
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, freeze_step=4)

    # N = 1: the same as the straightforward single-worker version, bit for bit, with and without decay
    for wd in (0.01, 0.0):
        g1 = [[g[0]] for g in grads]
        final1, st1 = simulate_onebit_lamb(params, g1, layouts=[("flat",)] * 3, **{**hp, "weight_decay": wd})
        ref1 = _plain_lamb_with_freezing(params, lambda t: g1[t - 1][0], n_steps=n_steps, **{**hp, "weight_decay": wd})
        assert all(np.array_equal(a, b) for a, b in zip(final1, ref1)), "N=1 differs from the plain version"
        assert not st1["worker_errors"].any() and not st1["server_errors"].any()
    print("N=1 equals single-worker LAMB with freezing, bit for bit")

    # N = 4, mixed layouts, one united buffer
    lays = [("flat",), ("zero", 1), ("flat",)]
    final, st = simulate_onebit_lamb(params, lambda t, k: grads[t - 1][k], n_workers=n, n_steps=n_steps,
                                     layouts=lays, **hp)
    c = united_width(shapes, lays, n)
    assert st["worker_errors"].shape == (n, n, c) and st["server_errors"].shape == (n, c)
    assert np.abs(st["worker_errors"]).max() > 0 and np.abs(st["server_errors"]).max() > 0
    assert all(np.isfinite(x).all() for x in final + st["m"] + st["v"] + st["v_fresh"])
    assert all(np.isfinite(x) for x in st["coeff_freeze"] + st["last_factor"] + st["scaling_coeff"])
    assert not all(np.array_equal(a, b) for a, b in zip(st["v"], st["v_fresh"]))  # v_fresh moved on
    # the factor moves at most by the threshold per step
    for j in range(len(shapes)):
        assert F32(0.9) ** (n_steps - 4) * F32(0.999) <= st["last_factor"][j] <= F32(1.1) ** (n_steps - 4) * F32(1.001)
    print(f"N={n}, layouts {lays}: last_factor {[round(float(x), 4) for x in st['last_factor']]}, "
          f"scaling_coeff {[round(float(x), 4) for x in st['scaling_coeff']]}")
    # gradients 10x larger after warm-up: v_fresh outgrows the frozen v, the factor falls to its clamps
    for name, gs in [("same gradients", grads),
                     ("gradients x10 after warm-up", [[[g * F32(10 if t >= 4 else 1) for g in gk] for gk in step]
                                                       for t, step in enumerate(grads)])]:
        hits = [h for step in simulate_onebit_lamb(params, gs, layouts=lays, **hp)[1]["factor_clamps"] for h in step]
        counts = {k: hits.count(k) for k in ("none", "max", "min", "threshold_up", "threshold_down") if k in hits}
        print(f"  {name}: {len(hits)} (compressed step, param) pairs, the factor's clamps {counts}")
    assert counts.get("threshold_down", 0) > 0 and counts.get("min", 0) > 0

    # freeze_step = 0: scales all 0, scaling_coeff 1, coeff_freeze 0: parameters never move
    final0, st0 = simulate_onebit_lamb(params, grads, layouts=lays, **{**hp, "freeze_step": 0})
    assert st0["scaling_coeff"] == [F32(1)] * 3 and all(np.array_equal(a, b) for a, b in zip(final0, params))
    assert all(np.isfinite(x).all() for x in st0["m"])
    # a param whose momentum is 0 at the end of warm-up gets scaling_coeff 1
    gz = [[[g[0], np.zeros(shapes[1], F32), g[2]] for g in step] for step in grads]
    _, stz = simulate_onebit_lamb(params, gz, layouts=lays, **hp)
    assert stz["scaling_coeff"][1] == F32(1) and stz["scaling_coeff"][0] != F32(1)
    print("freeze_step=0 and a zero momentum: scaling_coeff 1, finite; self-check passed")


if __name__ == "__main__":
    _self_check()

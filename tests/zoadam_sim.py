"""A plain numpy (float32) simulation of DeepSpeed's 0/1 Adam (ZeroOneAdam) on N data-parallel workers.

The reference that zeroflax's 0/1 Adam is tested against, built on onebit_sim.py (its compressed
all-reduce with error feedback, one buffer per parameter in the layout ("flat",) or ("zero", d), and its
float32 conventions: every operation rounded to float32, torch's `1 - b1` rounded from double,
left-to-right evaluation, sums over workers in worker order). Read against DeepSpeed's
`deepspeed/runtime/fp16/onebit/zoadam.py` (class `ZeroOneAdam`: `__init__` for the defaults
var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16, and
`step`), deepspeedai/DeepSpeed at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641. Every worker keeps
its own parameters, momentum m, momentum accumulator cb (DeepSpeed's `momentum_accumulator`, the
paper's u) and lrs; between syncs they differ from worker to worker.

Steps t = 1, 2, ... are all real: DeepSpeed's first `step` call only initialises, so its own counter is
s = t + 1. The schedule's tests read s, as DeepSpeed's do, so the kinds of steps are DeepSpeed's on its
real steps. Per step t (s = t + 1), per parameter (v only ever changes on "full" steps):

  not frozen, s % var_interval == 0 ("full"; g = mean of the local gradients, uncompressed, summed in
  worker order, times float32(1/N)):
      v = b2*v + (1-b2)*(g*g);   m = b1*m + (1-b1)*g
  not frozen, otherwise ("onebit_grad"):
      m = b1*m + (1-b1)*compressed_allreduce(g_0 .. g_{N-1})     (N == 1: the local gradient)
  frozen ("local", "local+sync"), worker k alone:
      m_k = b1*m_k + (1-b1)*g_k;   lrs_k = lrs_k + lr
  every step, worker k:
      update = m_k / (sqrt(v) + eps)  (+ weight_decay*p_k if weight_decay > 0)
      p_k = p_k - lr*update;   if frozen: cb_k = cb_k - lr*update
  frozen and s % local_step_interval == 0 ("local+sync"):
      p_k = p_k - cb_k;  cb_k = cb_k * (sqrt(v) + eps);  cb = compressed_allreduce(cb_0 .. cb_{N-1}) (N > 1)
      m_k = -(cb / lrs_k);  p_k = p_k + cb / (sqrt(v) + eps);  cb_k = 0;  lrs_k = 0
  then the counters: not frozen and s % var_interval == 0: var_counter += 1, and when it reaches
  var_update_scaler: var_counter = 0, var_interval *= 2. Frozen: local_step_counter += 1, and when it
  reaches local_step_scaler: local_step_counter = 0, local_step_interval = min(clipper, 2*interval).
  At the end of step t: if s > var_freeze_step and not yet frozen: frozen (from step t + 1 on, i.e.
  steps t > var_freeze_step are frozen), and every worker and server error is zeroed (DeepSpeed's
  `reinitial_error_buffer`: the errors of the gradients would otherwise feed the accumulated momenta).

Differences from DeepSpeed, by name:
  * DeepSpeed's first call, which only initialises, is not simulated (DeepSpeed's first real step is its
    s = 2, this step t = 1);
  * N == 1, "onebit_grad" step: m = b1*m + (1-b1)*g with the local gradient; DeepSpeed's
    `if self.size > 1:` leaves m untouched then;
  * lrs is a float32 sum of float32(lr) (DeepSpeed: a Python double, rounded to float32 in cb / lrs);
  * m after a sync is -(cb / lrs) (DeepSpeed: zero_() then add_(cb / lrs, alpha=-1), the same value);
  * no exp_avg_mask, constant lr, no bias correction (DeepSpeed's ZeroOneAdam has none).
After a sync the workers' m agree bit for bit, their parameters only to rounding: p_k - cb_k undoes
worker k's local steps in float32, which is not exact (as in DeepSpeed).

Public API: `simulate_zero_one_adam`, `zero_one_adam_schedule`. Run this file to execute its self-check.
"""
from __future__ import annotations

import numpy as np

from onebit_lamb_sim import _grad_source, _mean_grads
from onebit_sim import F32, compressed_allreduce, row_width

__all__ = ["simulate_zero_one_adam", "zero_one_adam_schedule"]


class _Counters:
    """DeepSpeed's interval counters (one set: DeepSpeed keeps one per param, all equal)."""

    def __init__(self, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper):
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.var_interval, self.var_counter = 1, 0
        self.local_step_interval, self.local_step_counter = 1, 0
        self.frozen = False

    def kind(self, t: int) -> str:
        s = t + 1  # DeepSpeed's own step counter (its first call only initialises)
        if not self.frozen:
            return "full" if s % self.var_interval == 0 else "onebit_grad"
        return "local+sync" if s % self.local_step_interval == 0 else "local"

    def advance(self, t: int) -> bool:
        """The end of step t; returns True when this step froze the variance."""
        s = t + 1
        if not self.frozen:
            if s % self.var_interval == 0:
                self.var_counter += 1
                if self.var_counter == self.var_update_scaler:
                    self.var_counter, self.var_interval = 0, self.var_interval * 2
        else:
            self.local_step_counter += 1
            if self.local_step_counter == self.local_step_scaler:
                self.local_step_counter = 0
                self.local_step_interval = min(self.local_step_clipper, self.local_step_interval * 2)
        if s > self.var_freeze_step and not self.frozen:
            self.frozen = True
            return True
        return False


def zero_one_adam_schedule(n_steps, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper):
    """The kind of each step t = 1 .. n_steps ("full", "onebit_grad", "local", "local+sync"), from the
    counters alone (no arithmetic): what each step communicates."""
    counters = _Counters(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)
    kinds = []
    for t in range(1, n_steps + 1):
        kinds.append(counters.kind(t))
        counters.advance(t)
    return kinds


def simulate_zero_one_adam(params, grads, *, lr, b1, b2, eps, weight_decay, var_freeze_step, var_update_scaler,
                           local_step_scaler, local_step_clipper, layouts, n_workers=None, n_steps=None):
    """Run 0/1 Adam on N simulated workers (module docstring).

    params: list of float32 arrays (the same on every worker at the start); grads: a callable
    (step from 1, worker) -> list of that worker's local gradients, or a nested list
    grads[step-1][worker][param] (n_workers / n_steps then default to its lengths; a callable needs both);
    layouts: per param ("flat",) or ("zero", d), each param its own compressed buffer.

    Returns (params_workers, state, log): params_workers[k] is worker k's list of float32 arrays;
    state has per worker "m", "cb" (lists over params) and "lrs" (float32); per param "v" and
    "worker_errors" (N, N, C) / "server_errors" (N, C); the counters "var_interval", "var_counter",
    "local_step_interval", "local_step_counter", "frozen"; and "step". log[t-1] is step t's kind.
    """
    params = [np.asarray(p, dtype=F32) for p in params]
    n_params, shapes = len(params), [p.shape for p in params]
    if len(layouts) != n_params:
        raise ValueError(f"{len(layouts)} layouts for {n_params} params")
    n, t_max, local_grads = _grad_source(grads, shapes, n_workers, n_steps)

    b1_, b2_, eps_, wd_, lr_ = F32(b1), F32(b2), F32(eps), F32(weight_decay), F32(lr)
    omb1, omb2 = F32(1.0 - b1), F32(1.0 - b2)
    widths = [row_width(s, tuple(lay), n) for s, lay in zip(shapes, layouts)]
    counters = _Counters(var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper)

    # every worker's own copy of everything
    p_w = [[p.copy() for p in params] for _ in range(n)]
    m_w = [[np.zeros_like(p) for p in params] for _ in range(n)]
    v_w = [[np.zeros_like(p) for p in params] for _ in range(n)]
    cb_w = [[np.zeros_like(p) for p in params] for _ in range(n)]
    lrs_w = [F32(0)] * n
    werr = [[np.zeros((n, c), F32) for _ in range(n)] for c in widths]  # werr[j][k]: param j, worker k
    serr = [[np.zeros((c,), F32) for _ in range(n)] for c in widths]  # serr[j][i]: param j, server i
    log = []

    def denom(k, j):
        return (np.sqrt(v_w[k][j]) + eps_).astype(F32)

    for t in range(1, t_max + 1):
        g_w = local_grads(t)
        kind = counters.kind(t)
        log.append(kind)

        if kind == "full":
            g_mean = _mean_grads(g_w)
            for k in range(n):
                for j in range(n_params):
                    g = g_mean[j]
                    v_w[k][j] = (b2_ * v_w[k][j] + omb2 * (g * g)).astype(F32)
                    m_w[k][j] = (b1_ * m_w[k][j] + omb1 * g).astype(F32)
        elif kind == "onebit_grad":
            for j in range(n_params):
                if n > 1:
                    res, werr[j], serr[j] = compressed_allreduce([g_w[k][j] for k in range(n)], werr[j], serr[j],
                                                                 tuple(layouts[j]))
                else:
                    res = [g_w[0][j]]  # DeepSpeed leaves m untouched with one worker
                for k in range(n):
                    m_w[k][j] = (b1_ * m_w[k][j] + omb1 * res[k]).astype(F32)
        else:  # frozen: local momentum
            for k in range(n):
                for j in range(n_params):
                    m_w[k][j] = (b1_ * m_w[k][j] + omb1 * g_w[k][j]).astype(F32)
                lrs_w[k] = F32(lrs_w[k] + lr_)

        for k in range(n):
            for j in range(n_params):
                update = (m_w[k][j] / denom(k, j)).astype(F32)
                if weight_decay > 0.0:
                    update = (update + wd_ * p_w[k][j]).astype(F32)
                p_w[k][j] = (p_w[k][j] - lr_ * update).astype(F32)
                if counters.frozen:
                    cb_w[k][j] = (cb_w[k][j] - lr_ * update).astype(F32)

        if kind == "local+sync":
            for j in range(n_params):
                for k in range(n):
                    p_w[k][j] = (p_w[k][j] - cb_w[k][j]).astype(F32)
                    cb_w[k][j] = (cb_w[k][j] * denom(k, j)).astype(F32)
                if n > 1:
                    res, werr[j], serr[j] = compressed_allreduce([cb_w[k][j] for k in range(n)], werr[j], serr[j],
                                                                 tuple(layouts[j]))
                    for k in range(n):
                        cb_w[k][j] = res[k]
                for k in range(n):
                    m_w[k][j] = (-(cb_w[k][j] / lrs_w[k])).astype(F32)
                    p_w[k][j] = (p_w[k][j] + cb_w[k][j] / denom(k, j)).astype(F32)
                    cb_w[k][j] = np.zeros_like(cb_w[k][j])
            for k in range(1, n):
                assert all(np.array_equal(m_w[k][j], m_w[0][j]) for j in range(n_params)), f"step {t}: m differs"
            lrs_w = [F32(0)] * n

        if counters.advance(t):  # frozen from step t + 1: the errors start afresh
            werr = [[np.zeros_like(e) for e in errs] for errs in werr]
            serr = [[np.zeros_like(e) for e in errs] for errs in serr]

        if kind in ("full", "onebit_grad"):  # before the freeze every worker holds the same values
            for k in range(1, n):
                for j in range(n_params):
                    assert np.array_equal(p_w[k][j], p_w[0][j]), f"step {t}: worker {k} param {j} differs"
                    assert np.array_equal(m_w[k][j], m_w[0][j]), f"step {t}: worker {k} m {j} differs"
    for k in range(1, n):
        assert all(np.array_equal(v_w[k][j], v_w[0][j]) for j in range(n_params)), f"worker {k}: v differs"

    state = {
        "m": [[m.copy() for m in ms] for ms in m_w], "cb": [[c.copy() for c in cs] for cs in cb_w],
        "lrs": list(lrs_w), "v": [v.copy() for v in v_w[0]],
        "worker_errors": [np.stack(e) for e in werr], "server_errors": [np.stack(e) for e in serr],
        "var_interval": counters.var_interval, "var_counter": counters.var_counter,
        "local_step_interval": counters.local_step_interval, "local_step_counter": counters.local_step_counter,
        "frozen": counters.frozen, "step": t_max,
    }
    return [[p.copy() for p in ps] for ps in p_w], state, log


# ----------------------------------------------------------------------------------------------
# self-check


def _plain_adam(params, grad_of, *, lr, b1, b2, eps, weight_decay, n_steps):
    """Adam without bias correction (eps outside the square root), written out separately."""
    ps = [np.asarray(p, F32).copy() for p in params]
    ms, vs = [np.zeros_like(p) for p in ps], [np.zeros_like(p) for p in ps]
    for t in range(1, n_steps + 1):
        for j, g in enumerate(grad_of(t)):
            g = np.asarray(g, F32)
            vs[j] = (F32(b2) * vs[j] + F32(1 - b2) * (g * g)).astype(F32)
            ms[j] = (F32(b1) * ms[j] + F32(1 - b1) * g).astype(F32)
            u = (ms[j] / (np.sqrt(vs[j]) + F32(eps))).astype(F32)
            u = (u + F32(weight_decay) * ps[j]).astype(F32) if weight_decay > 0 else u
            ps[j] = (ps[j] - F32(lr) * u).astype(F32)
    return ps


def _self_check() -> None:
    rng = np.random.default_rng(2)
    # the schedule, worked out by hand on DeepSpeed's counter s = t + 1: var_interval 1 (s = 2, 3), 2 (s = 4,
    # 5), then 4; frozen after step t = 6 (s = 7 > var_freeze_step = 6); local_step_interval 1 (s = 8, 9),
    # 2 (s = 10, 11), then 4
    sched = zero_one_adam_schedule(16, 6, 2, 2, 4)
    short = {"full": "F", "onebit_grad": "1", "local": "L", "local+sync": "S"}
    assert "".join(short[k] for k in sched) == "FFF1F1SSSLSLLLSL", sched
    default = zero_one_adam_schedule(200, 100, 16, 32678, 16)
    assert default[:16] == ["full"] * 16 and default[16:20] == ["full", "onebit_grad"] * 2
    assert default[99] != "local+sync" and set(default[100:]) == {"local+sync"}  # interval 1 for 32678 steps
    print("schedule (16 steps, var_freeze_step 6, scalers 2, 2, clipper 4):", "".join(short[k] for k in sched))

    shapes = [(13,), (6, 8)]
    params = [rng.standard_normal(s).astype(F32) for s in shapes]
    n, n_steps = 4, 16
    grads = [[[rng.standard_normal(s).astype(F32) for s in shapes] for _ in range(n)] for _ in range(n_steps)]
    hp = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
    sc = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)

    # all full steps (var_update_scaler past n_steps, no freeze): Adam without bias correction on the mean
    # gradient, for N = 1 and N = 4, bit for bit
    allfull = dict(var_freeze_step=10**6, var_update_scaler=10**6, local_step_scaler=2, local_step_clipper=4)
    for nn in (1, n):
        g = [step[:nn] for step in grads]
        pw, st, log = simulate_zero_one_adam(params, g, layouts=[("flat",)] * 2, **hp, **allfull)
        mean = lambda t: _mean_grads(g[t - 1])  # noqa: E731
        ref = _plain_adam(params, mean, n_steps=n_steps, **hp)
        assert log == ["full"] * n_steps and all(np.array_equal(a, b) for a, b in zip(pw[0], ref))
        assert all(not e.any() for e in st["worker_errors"] + st["server_errors"])
    print(f"N=1 and N={n} with only full steps equal Adam without bias correction, bit for bit")

    # N = 4, every kind of step, ZeRO and flat layouts; ending on a sync step and on a local step
    lays = [("flat",), ("zero", 1)]
    pw, st, log = simulate_zero_one_adam(params, lambda t, k: grads[t - 1][k], n_workers=n, n_steps=n_steps - 1,
                                         layouts=lays, **hp, **sc)
    assert log == sched[:-1] and log[-1] == "local+sync"
    assert st["worker_errors"][1].shape == (n, n, row_width((6, 8), ("zero", 1), n))
    assert all(np.abs(e).max() > 0 for e in st["worker_errors"] + st["server_errors"])
    assert st["lrs"] == [F32(0)] * n and all(not c.any() for cs in st["cb"] for c in cs)
    assert (st["local_step_interval"], st["local_step_counter"], st["var_interval"]) == (4, 1, 4) and st["frozen"]
    diff = max(float(np.abs(pw[k][j] - pw[0][j]).max()) for k in range(n) for j in range(2))
    size = max(float(np.abs(p).max()) for p in pw[0])
    print(f"N={n}, {log.count('local+sync')} syncs: right after the last, the workers' params differ by "
          f"{diff:.2e} at most (rounding; |p| <= {size:.2f})")
    assert diff <= 4 * np.finfo(F32).eps * size
    assert all(np.array_equal(st["m"][k][j], st["m"][0][j]) for k in range(n) for j in range(2))
    pw15, st15, log15 = simulate_zero_one_adam(params, grads, layouts=lays, n_steps=16, **hp, **sc)
    assert log15 == sched and log15[-1] == "local" and st15["lrs"] == [F32(1e-2)] * n  # step 16 since the sync of 15
    spread = max(float(np.abs(pw15[k][j] - pw15[0][j]).max()) for k in range(n) for j in range(2))
    assert spread > 100 * diff  # between syncs each worker goes its own way
    assert all(np.isfinite(p).all() for ps in pw + pw15 for p in ps)

    # the errors are zeroed when the variance freezes: var_freeze_step = n_steps freezes after the last step
    _, st_f, _ = simulate_zero_one_adam(params, grads, layouts=lays, **hp, **{**sc, "var_freeze_step": n_steps})
    assert all(not e.any() for e in st_f["worker_errors"] + st_f["server_errors"]) and st_f["frozen"]
    print("self-check passed")


if __name__ == "__main__":
    _self_check()

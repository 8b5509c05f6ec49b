"""0/1 Adam (DeepSpeed's ZeroOneAdam): Adam whose variance is updated at exponentially rarer steps and
then frozen, whose gradients are exchanged compressed between those steps, and which, once the variance
is frozen, lets each device take local steps, exchanging (compressed) only the sum of its updates at
exponentially rarer sync steps (docs/onebit_adam.md, "0/1 Adam").

The update of a leaf p at update count t (1-based; no bias correction, eps outside the square root), by
the kind of step `step_kinds` gives t:

  'full'         g the mean gradient:   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
  'onebit_grad'  g the mean gradient through the compressed all-reduce:  m = b1 m + (1 - b1) g
      both:  p -= lr (m / (sqrt(v) + eps) + weight_decay p)
  'local'        each device k alone (the sync part, `zeroflax/step/zero_one_sync.py`): m_k = b1 m_k + (1 - b1) g_k,
                 u = m_k / (sqrt(v) + eps) + weight_decay p_k,  p_k -= lr u,  acc_k -= lr u,  lrs += lr
  'sync'         a local step, then acc = compressed all-reduce of acc_k (sqrt(v) + eps):
                 p = p_k - acc_k + acc / (sqrt(v) + eps) (the same on every device),  m = -acc / lrs,  acc_k = 0,  lrs = 0

The schedule (`step_kinds`), on DeepSpeed's own counter s = t + 1 (its first call only initialises, so its
real steps are s = 2, 3, ...: the kinds are DeepSpeed's on its real steps): before the variance freezes
(t <= var_freeze_step) a step is 'full' when var_interval divides s, else 'onebit_grad'; var_interval doubles
after every var_update_scaler full steps. After, a step is 'sync' when local_interval divides s, else
'local'; local_interval doubles after every local_step_scaler frozen steps, up to local_step_clipper.

Called by itself (no engine, no sync) every step is 'full': Adam without bias correction.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zeroflax.optim.onebit import CompressedMomentum, check_arguments

FULL, ONEBIT_GRAD, LOCAL, SYNC = "full", "onebit_grad", "local", "sync"


class ZeroOneAdamState(NamedTuple):
    count: jax.Array  # int32: updates applied
    mu: Any  # momentum; during local steps each device's own lives in the sync state
    nu: Any  # variance, updated at 'full' steps only


@dataclasses.dataclass(frozen=True)
class ZeroOneSettings:
    learning_rate: Any  # float or optax schedule of the update count
    b1: float
    b2: float
    eps: float
    weight_decay: float
    var_freeze_step: int
    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    local_clip: bool = False  # as onebit_adam's


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Where the schedule stands after some steps (host integers)."""

    var_interval: int = 1
    var_counter: int = 0
    local_interval: int = 1
    local_counter: int = 0


def kind_of(settings: ZeroOneSettings, t: int, at: Schedule) -> str:
    """The kind of step t (1-based) when the schedule stands at `at` (after step t - 1). The modulo tests read
    DeepSpeed's own counter, t + 1 (its first call only initialises), so the kinds are DeepSpeed's on its real
    steps; steps t > var_freeze_step are frozen (DeepSpeed freezes after its step t + 1 > var_freeze_step)."""
    s = t + 1
    if t <= settings.var_freeze_step:
        return FULL if s % at.var_interval == 0 else ONEBIT_GRAD
    return SYNC if s % at.local_interval == 0 else LOCAL


def advance(settings: ZeroOneSettings, t: int, at: Schedule) -> Schedule:
    """The schedule after step t."""
    s = settings
    if t <= s.var_freeze_step:
        if (t + 1) % at.var_interval:
            return at
        counter = at.var_counter + 1
        if counter == s.var_update_scaler:
            return dataclasses.replace(at, var_interval=at.var_interval * 2, var_counter=0)
        return dataclasses.replace(at, var_counter=counter)
    counter = at.local_counter + 1
    if counter == s.local_step_scaler:
        return dataclasses.replace(at, local_interval=min(s.local_step_clipper, at.local_interval * 2),
                                   local_counter=0)
    return dataclasses.replace(at, local_counter=counter)


def step_kinds(settings: ZeroOneSettings, steps: int) -> list[str]:
    """The kinds of steps 1..steps."""
    kinds, at = [], Schedule()
    for t in range(1, steps + 1):
        kinds.append(kind_of(settings, t, at))
        at = advance(settings, t, at)
    return kinds


@dataclasses.dataclass(frozen=True)
class _Update:
    settings: ZeroOneSettings

    def __call__(self, grads, state: ZeroOneAdamState, params=None, *, kind: str = FULL, lrs=None, **_):
        """`kind` (from the engine's sync): FULL or ONEBIT_GRAD: `grads` is the (exchanged) mean gradient;
        LOCAL: the devices stepped alone, nothing at rest changes; SYNC: `grads` is the exchanged sum of the
        devices' scaled updates and `lrs` the sum of their learning rates."""
        s = self.settings
        count = state.count + 1
        if kind == LOCAL:
            return jax.tree.map(jnp.zeros_like, grads), state._replace(count=count)
        if kind == SYNC:
            updates = jax.tree.map(lambda a, v: (a / (jnp.sqrt(v) + s.eps)).astype(a.dtype), grads, state.nu)
            mu = jax.tree.map(lambda a: -(a / lrs), grads)
            return updates, ZeroOneAdamState(count, mu, state.nu)
        if s.weight_decay and params is None:
            raise ValueError("zero_one_adam with weight_decay needs params in update(grads, state, params)")
        mu = jax.tree.map(lambda m, g: s.b1 * m + (1 - s.b1) * g, state.mu, grads)
        nu = state.nu if kind == ONEBIT_GRAD else jax.tree.map(lambda v, g: s.b2 * v + (1 - s.b2) * g * g,
                                                                 state.nu, grads)
        lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate

        def step(m, v, p):
            update = m / (jnp.sqrt(v) + s.eps)
            if s.weight_decay:
                update = update + s.weight_decay * p
            return (-lr * update).astype(m.dtype)

        return jax.tree.map(step, mu, nu, params if params is not None else mu), ZeroOneAdamState(count, mu, nu)


class ZeroOneAdam(CompressedMomentum):
    """What `zero_one_adam` returns: an optax transformation the engine recognises (`settings`)."""

    __slots__ = ()


def zero_one_adam(learning_rate: float | Callable = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                  local_step_scaler: int = 32678, local_step_clipper: int = 16,
                  local_clip: bool = False) -> ZeroOneAdam:
    """DeepSpeed's 0/1 Adam (defaults: DeepSpeed's). Pass the result to `zeroflax.initialize` as the optimizer,
    itself; `local_clip` as onebit_adam's. The first step is a real one (DeepSpeed's first call only
    initialises)."""
    check_arguments("zero_one_adam", eps, weight_decay, {"b1": b1, "b2": b2},
                    {"var_freeze_step": (var_freeze_step, 0), "var_update_scaler": (var_update_scaler, 1),
                     "local_step_scaler": (local_step_scaler, 1), "local_step_clipper": (local_step_clipper, 1)})
    settings = ZeroOneSettings(learning_rate, b1, b2, eps, weight_decay, var_freeze_step, var_update_scaler,
                               local_step_scaler, local_step_clipper, bool(local_clip))

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return ZeroOneAdamState(jnp.zeros((), jnp.int32), zeros(), zeros())

    return ZeroOneAdam(init, _Update(settings))

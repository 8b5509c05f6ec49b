"""Memory report: per-device bytes of the compiled step, by category, beside ZeRO's theory.

The totals come from XLA (`compiled.memory_analysis()`): arguments, outputs, temporaries. The
arguments are split into categories by the shardings of the train state (what one device holds of
each leaf); `unaccounted` is what memory_analysis counts beyond them and should be ~0.
`grad_buffer` is the gradient buffer held from the backward pass to the update, from the plan:
full size where gradients are accumulated unreduced (stages 0 and 1), one shard for stages 2 and 3.
It lives in the temporaries.

Theory (design.md section 4) for model states at rest, with Psi parameters, N data-parallel devices,
P the parameters' bytes per element and K the optimizer state's bytes per parameter (Adam: 8):
    stage 0: (P + K) Psi    stages 1, 2: P Psi + K Psi / N    stage 3: (P + K) Psi / N
"""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from zeroflax.sharding.policy import shard_bytes


@dataclasses.dataclass
class MemoryReport:
    stage: int
    data_size: int
    num_params: int
    params: int
    opt_state: int
    grad_buffer: int
    other_state: int
    batch: int
    argument: int
    output: int
    temp: int
    alias: int
    theory_at_rest: float

    @property
    def at_rest(self) -> int:
        """Model states at rest: parameters and optimizer state held by one device."""
        return self.params + self.opt_state

    @property
    def ratio(self) -> float:
        return self.at_rest / self.theory_at_rest

    @property
    def unaccounted(self) -> int:
        return self.argument - (self.params + self.opt_state + self.other_state + self.batch)

    @property
    def peak_estimate(self) -> int:
        """Arguments + temporaries + outputs not aliased to (donated) arguments."""
        return self.argument + self.temp + self.output - self.alias

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(at_rest=self.at_rest, ratio=self.ratio, unaccounted=self.unaccounted,
                   peak_estimate=self.peak_estimate)
        return json.loads(json.dumps(out))

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:12.2f}"
        rows = [
            ("params", self.params), ("optimizer state", self.opt_state),
            ("gradient buffer (in temp)", self.grad_buffer), ("other state", self.other_state),
            ("batch", self.batch), ("arguments (XLA)", self.argument), ("outputs (XLA)", self.output),
            ("temporaries (XLA)", self.temp), ("aliased (donated)", self.alias),
            ("peak estimate", self.peak_estimate),
        ]
        lines = [f"memory per device (ZeRO stage {self.stage}, N={self.data_size}, Psi={self.num_params:,})",
                 f"  {'category':<28}{'MiB':>12}"]
        lines += [f"  {name:<28}{mib(value)}" for name, value in rows]
        lines.append(f"  {'model states at rest':<28}{mib(self.at_rest)}   theory {self.theory_at_rest / 2**20:.2f} MiB,"
                     f" ratio {self.ratio:.3f}")
        return "\n".join(lines)


def _bytes(x) -> int:
    return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize


def theory_at_rest(stage: int, num_params: int, data_size: int, param_bytes: float, opt_bytes: float) -> float:
    params = param_bytes * num_params / (data_size if stage == 3 else 1)
    opt = opt_bytes * num_params / (data_size if stage >= 1 else 1)
    return params + opt


def memory_report(engine, state, batch) -> MemoryReport:
    compiled = engine.compile(state, batch)
    stats = compiled.memory_analysis()
    plan = engine.plan
    shardings = engine.state_shardings
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    params = shard_bytes(abstract.params, shardings.params)
    opt = shard_bytes(abstract.opt_state, shardings.opt_state)
    other = (shard_bytes(abstract.step, shardings.step) + shard_bytes(abstract.rng, shardings.rng)
             + shard_bytes(abstract.loss_scale, shardings.loss_scale))
    # Host data is this process's rows of the batch; every device holds 1/data_size of the whole.
    batch_bytes = sum(_bytes(x) * (1 if isinstance(x, jax.Array) else jax.process_count())
                      for x in jax.tree.leaves(batch)) // engine.data_size
    # Stages 0-1 accumulate unreduced gradients in full; stages 2-3 hold one shard.
    with_data = engine.config.zero_stage >= 2
    grad_shardings = jax.tree.map(lambda p: jax.sharding.NamedSharding(plan.mesh, p.spec(with_data)),
                                  plan.placements, is_leaf=lambda x: hasattr(x, "zero_dim"))
    grads = shard_bytes(abstract.params, grad_shardings)

    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract.params))
    full_params = sum(_bytes(x) for x in jax.tree.leaves(abstract.params))
    full_opt = sum(_bytes(x) for x in jax.tree.leaves(abstract.opt_state))
    return MemoryReport(
        stage=engine.config.zero_stage, data_size=engine.data_size, num_params=num_params,
        params=params, opt_state=opt, grad_buffer=grads, other_state=other, batch=batch_bytes,
        argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes, alias=stats.alias_size_in_bytes,
        theory_at_rest=theory_at_rest(engine.config.zero_stage, num_params, engine.data_size,
                                      full_params / num_params, full_opt / num_params))

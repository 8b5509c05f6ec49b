"""The protocols of the step's parts and what they hand each other.

One step (`Engine._train_step`) is, top to bottom:

  GradSource   inside a shard_map manual over its `manual_axes`: the loss over this device's
               micro-batches and their gradients (`Accumulation`; the pipeline schedule, `Pipelined`),
               applying the sync's `per_microbatch` to each micro-batch's gradients;
  GradSync     the same shard_map: `final` reduces the accumulated gradients over `data` (ZeRO's
               all-reduce / reduce-scatter, `step/zero_sync.py`; 1-bit Adam's compressed exchange,
               `step/onebit_sync.py`); in the global view `synced` hands the update a `Synced`;
  LossScaler   unscales the gradients and follows the overflows (`step/scaler.py`);
  Update       the optimizer on the synchronised gradients, returning `Updated` (on the device,
               `step/device_update.py`; offloaded, possibly delayed, `step/offloaded_update.py`); with the
               state on disk, its `finish` streams the update after the compiled step
               (`step/streamed_update.py`).

Each part owns its state fields in `TrainState` (see `step/state.py`) and its phases (`step/phases.py`).
A new scheme is a new object satisfying one protocol, chosen in `step/build.py`: the engine does not
change (docs/design.md section 4).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from jax.sharding import PartitionSpec


@dataclasses.dataclass
class Synced:
    """What the gradient sync hands the update (global view, at the gradients' sharding)."""

    grads: Any  # what the optimizer takes as its gradient (1-bit Adam: the exchanged momentum)
    state: Any = None  # the sync's next state (TrainState.sync_state)
    norm: Any = None  # the gradient norm where the sync measured it (and clipped); None: the update does
    extra: dict = dataclasses.field(default_factory=dict)  # keyword arguments of `optimizer.update` (param-shaped)
    options: dict = dataclasses.field(default_factory=dict)  # other keyword arguments of `optimizer.update`
    moves_params: bool = True  # False: the step leaves the parameters at rest as they are (0/1 Adam's local
    # steps, where each device steps alone in the sync state), so the update keeps them without a collective


@dataclasses.dataclass
class Updated:
    """What the update returns: new parameters and optimizer state, the step's gradient norm, whether it
    was finite, and the update's own TrainState fields."""

    params: Any
    opt_state: Any
    grad_norm: Any
    finite: Any
    fields: dict = dataclasses.field(default_factory=dict)


class GradSource(Protocol):
    manual_axes: frozenset  # the mesh axes the gradient shard_map is manual over
    schedule: Any  # the pipeline schedule (pipeline/schedule.py), or None
    layer_order: Any  # storage row -> model layer of the stacked layers, or None (the identity)

    def __call__(self, trace, params, micro, rng, seed, model_state, sources, per_microbatch: Callable):
        """(gradient sum, mean loss, mean aux, model state) of this device's micro-batches `micro`
        (leading axis: the micro-batch), each loss scaled by `seed`; loss, aux and model state are
        already averaged over the manual axes. `trace` is the engine's `LossTrace`."""

    def after_sync(self, grads):
        """The gradients after the sync's `final` (the pipeline sums the shared leaves' over `pipe`)."""


class GradSync(Protocol):
    phases: tuple[str, ...]

    def init_state(self) -> Any: ...
    def shardings(self, mesh) -> Any: ...
    def state_bytes(self) -> int:
        """Its state's bytes per device (the memory report's theory)."""

    def data_axis_bytes(self, zero_bytes: float, stage: int, grad_bytes: int, phase: str) -> float:
        """Its bytes per device over `data` in a step of `phase` (the communication report's theory);
        `zero_bytes` is ZeRO's volume for the same step."""

    def inputs(self, state, phase: str) -> tuple[Any, Any]:
        """(what `final` takes besides the gradients, read from the TrainState; its shard_map specs)."""

    def per_microbatch(self, grads, phase: str): ...

    def local_params(self, params, inputs, phase: str):
        """Per device: the parameters this device's loss is taken at (its own where devices step alone between
        syncs, 0/1 Adam's local steps; else `params`)."""

    def final(self, grads, inputs, phase: str, scale) -> tuple[Any, Any]:
        """Per device: (the reduced gradients divided by the loss scale `scale`, outputs for `synced`). The
        sync divides where it is right and cheapest for it: ZeRO's after its reduction, on the shards; 1-bit
        Adam's compressed phase before its exchange, which must see the true gradient."""

    def output_specs(self, phase: str) -> PartitionSpec | Any: ...

    def synced(self, grads, outputs, state, phase: str) -> Synced: ...


class Update(Protocol):
    phases: tuple[str, ...]
    store: Any  # the files holding the master weights and optimizer state (NVMe offload), or None
    skips_nonfinite: bool  # a step with a non-finite gradient is skipped in the step (fp16, nonfinite 'skip')

    def field_shardings(self) -> dict:
        """Shardings of the update's own TrainState fields ({} when it has none)."""

    def abstract_fields(self, abstract_params) -> dict: ...
    def init_fields(self, params) -> dict: ...

    def loss_params(self, state):
        """What the loss differentiates (the master weights, or offload's compute copy)."""

    def readable(self, state):
        """The parameters where the device can compute with them, in the step (evaluation)."""

    def master(self, state):
        """The master weights, stored (`Engine.model_params`; read from the file under NVMe offload)."""

    def initial(self, params, opt_init):
        """(master weights, optimizer state) of a fresh TrainState from the initial master weights `params`
        (stored, placed); `opt_init` makes the optimizer state of stored master weights."""

    def refreshed(self, state):
        """`state` with the update's derived fields remade from its master weights."""

    def restored(self, state):
        """A fresh or restored state as the step takes it (derived fields remade where missing)."""

    def stored(self, state):
        """`state` as a checkpoint holds it (derived fields that can be remade dropped)."""

    def __call__(self, state, synced: Synced, phase: str) -> Updated: ...

    def finish(self, state, metrics):
        """After the compiled step, on the host: the state the step really ends with (the NVMe update streams
        the state through its file here; the others return `state`)."""

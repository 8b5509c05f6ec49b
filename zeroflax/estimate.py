"""`zeroflax estimate`: memory per device, per host and on disk for ZeRO stages 0-3, with and without offload.

Two independent columns, each with its source:

- **DeepSpeed**: the formulas of DeepSpeed's published estimators, `estimate_zero2_model_states_mem_needs`
  (deepspeed/runtime/zero/stage_1_and_2.py) and `estimate_zero3_model_states_mem_needs`
  (deepspeed/runtime/zero/stage3.py), reimplemented here (`deepspeed_zero2`, `deepspeed_zero3`) and
  checked case by case against DeepSpeed's own functions (tools/gen_deepspeed_estimates.py,
  tests/data/deepspeed_estimates.json). DeepSpeed publishes them for stages 2 and 3 only; its GPU
  figure is model states with gradients (16-bit parameters, 16- and 32-bit gradients, 32-bit master
  weights and Adam), its CPU figure is per node. It has no NVMe row (its functions take no NVMe flag), so
  the 'nvme' rows have no DeepSpeed figures.
- **zeroflax**: this engine's placement, leaf by leaf (`zeroflax_states`): the sharding policy's own rule
  (`sharding.policy.zero_placement`: the persistence threshold, and padding where the data size divides
  no free dimension) on the mesh (tensor and pipe slicing through the logical rules), fp32 master weights (P bytes), the
  optimizer's state (K bytes per parameter, Adam 8), the compute-dtype copy under offload, and the
  gradient buffer (docs/design.md sections 2 and 5; memory.theory_at_rest and
  OffloadedUpdate.at_rest_theory give the same figures when every leaf is partitioned). Per device it gives:

    at rest     parameters, optimizer state (and under offload the compute copy) in device memory; under
                offload the master weights and optimizer state are in host memory instead (12 Psi / N),
                counted per device and per host (times the devices per node)
    disk        (rows 'nvme', ZeRO-Infinity: OffloadOptimizerConfig.device 'nvme') the master weights and
                optimizer state are in a file instead, true elements only (no padding): (4 + K) Psi / N per
                device (12 Psi / N with Adam), per node times the devices per node; a leaf below the
                persistence threshold counts whole per device, as the host column counts it (the file of a
                process holds it once). The device keeps the compute copy, as under 'optimizer', and the
                reduced fp32 gradient shard (`pending_grads`, 4 Psi / N, at every stage 1-3) that the
                update streams after the step; host memory holds only the stream's buffers, per process:
                buffer_count x min(buffer_size, the largest leaf shard) x (4 + K) bytes. Per step the file
                is read once and written once: the disk figure each way
    + grads     at rest plus the gradient buffer (full fp32 at stages 0-1, a shard at 2-3): the
                quantity DeepSpeed's GPU figure describes
    arguments   (a gin config) at rest + this device's rows of the batch: the step's arguments (an
                'nvme' row's `pending_grads` too: the step only writes them, but it takes the state whole,
                donated, so the new ones reuse the old buffer)
    peak        (a GPT from gin, no pipe axis) arguments + gradients + the activations one micro-batch
                keeps for the backward pass under the remat policy + the layer being recomputed
                (`gpt_peak`): a model of XLA's `memory_analysis()` argument + output + temp - alias

tests/test_estimate.py compares the arguments (with the host states) with
`compiled.memory_analysis().argument_size_in_bytes`, and the peak with argument + output + temp - alias,
of the real engine on 8 simulated devices (stages 0-3, offload, and NVMe, whose state on disk is in no
argument): on the CPU backend host memory is device memory, so both include the host's share there.
docs/plan.md has the measured errors.
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Any

from zeroflax.axes import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS
from zeroflax.config import ConfigError

MASTER_BYTES = 4  # fp32 master weights and gradients
ADAM_BYTES = 8  # Adam's two fp32 moments per parameter
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# (stage, offload) rows of the table: offload 'none', 'optimizer' (offload_optimizer cpu), 'optimizer+param',
# 'nvme' (offload_optimizer nvme: the state on disk, streamed through host buffers; offload_param 'none').
ROWS = ((0, "none"), (1, "none"), (1, "optimizer"), (1, "nvme"), (2, "none"), (2, "optimizer"), (2, "nvme"),
        (3, "none"), (3, "optimizer"), (3, "optimizer+param"), (3, "nvme"))
# The nvme_path of a row when the input config has none: the estimate and compile-only tools write no file.
NVME_PLACEHOLDER = "/nvme"


# --------------------------------------------------------------------------- DeepSpeed's formulas
def deepspeed_zero2(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                    additional_buffer_factor=1.5) -> tuple[int, int]:
    """(CPU bytes per node, GPU bytes per GPU) by DeepSpeed's ZeRO-2 estimator formula.

    Per GPU: 2 bytes per parameter for the 16-bit parameters, and, unless the optimizer is offloaded,
    18 bytes per parameter over all GPUs (16-bit and 32-bit gradients 2 + 4, fp32 master 4, Adam 8).
    Per node: offloaded, those states for the node, at least 16 bytes per parameter (scaled by the
    buffer factor); otherwise a 4-byte copy of the model per GPU of the node. The operations run in
    DeepSpeed's order so the integers match bit for bit."""
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def deepspeed_zero3(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
                    cpu_offload_params=True, zero_init=True, additional_buffer_factor=1.5) -> tuple[int, int, int]:
    """(CPU bytes per node, GPU bytes per GPU, largest layer bytes) by DeepSpeed's ZeRO-3 estimator formula.

    Every GPU holds one largest layer at 4 bytes per parameter while it is gathered. Without offload the
    18 bytes per parameter are split over all GPUs; offloading the optimizer leaves the 16-bit
    parameters' share (2 / GPUs) and moves 16 bytes per parameter (per node: their share of the nodes)
    to the CPU; offloading the parameters too leaves only the gathered layer and moves 18. zero_init
    False makes the CPU hold at least a 4-byte model copy per GPU of the node. cpu_offload_params without
    cpu_offload counts as no offload, as in DeepSpeed."""
    gpus = num_nodes * num_gpus_per_node
    node_share = 1 / num_nodes
    layer = 4 * largest_layer_params
    if not cpu_offload:
        gpu = layer + int(18 * total_params / gpus)
        cpu = (largest_layer_params if zero_init else total_params) * 4 * num_gpus_per_node * additional_buffer_factor
        return int(cpu), int(gpu), layer
    per_param = 18 if cpu_offload_params else 16
    gpu = layer if cpu_offload_params else layer + int(2 * total_params / gpus)
    if zero_init:
        cpu = total_params * per_param * node_share * additional_buffer_factor
    else:
        cpu = total_params * max(4 * num_gpus_per_node, per_param * node_share) * additional_buffer_factor
    return int(cpu), int(gpu), layer


# --------------------------------------------------------------------------- the model, as leaves
@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter leaf: its shape and logical axis names (None: unnamed, replicated over tensor/pipe)."""
    shape: tuple
    names: tuple | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return bool(self.names) and self.names[0] == "layers"


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the estimate needs to know of a model."""
    leaves: tuple  # of Leaf
    largest_layer_params: int  # DeepSpeed's largest_layer_params (the biggest single module)
    opt_bytes: float = ADAM_BYTES  # optimizer state bytes per parameter (partitioned like the parameter)
    opt_other_bytes: int = 0  # optimizer state that is not parameter-shaped (step counts; replicated)
    name: str = "model"
    gpt: Any = None  # a GPTConfig when the model is zeroflax's GPT (the peak is modeled for it only)

    @property
    def num_params(self) -> int:
        return sum(leaf.size for leaf in self.leaves)


def spec_from_params(params: float, largest_layer_params: float | None = None) -> ModelSpec:
    """A bare parameter count: one leaf, partitioned over every axis (nothing below the persistence
    threshold, all of it tensor- and pipe-sliced). The largest layer defaults to none (0)."""
    if not (params >= 1 and float(params).is_integer()):
        raise ConfigError("--params", f"must be a whole number of parameters >= 1, got {params!r}")
    largest = 0 if largest_layer_params is None else largest_layer_params
    if not (0 <= largest <= params and float(largest).is_integer()):
        raise ConfigError("--largest_layer_params", f"must be a whole number in [0, --params], got {largest!r}")
    return ModelSpec((Leaf((int(params),), ("flat",)),), int(largest), name=f"{int(params):,} parameters")


def spec_from_gpt(gpt, optimizer=None) -> ModelSpec:
    """The GPT's leaves with their logical names, from an abstract init (nothing is allocated)."""
    import jax
    import jax.numpy as jnp
    import optax

    from zeroflax.adapters import unbox
    from zeroflax.models.gpt import GPT

    model = GPT(gpt)
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"])
    values, names = unbox(boxed)
    flat = jax.tree.leaves(values)
    flat_names = jax.tree.structure(values).flatten_up_to(names) if names is not None else [None] * len(flat)
    leaves = tuple(Leaf(tuple(x.shape), None if n is None else tuple(n)) for x, n in zip(flat, flat_names))
    # DeepSpeed's largest layer is the biggest module's own parameters; a torch GPT's modules are its
    # Linear and Embedding layers, so here: the biggest leaf (one layer's slice of a stacked leaf).
    largest = max(math.prod(l.shape[1:]) if l.stacked else l.size for l in leaves)
    per_param, other = opt_bytes(values, jax.eval_shape((optimizer or optax.adamw(1e-3)).init, values))
    num = sum(l.size for l in leaves)
    return ModelSpec(leaves, largest, per_param, other, name=f"GPT ({num:,} parameters)", gpt=gpt)


def opt_bytes(abstract_params, abstract_opt) -> tuple[float, int]:
    """(bytes per parameter of the optimizer's parameter-shaped state, bytes of the rest): K, and the state
    that is no parameter's (step counts). A state leaf counts as parameter-shaped when some parameter has its
    shape (not rank 0)."""
    import jax

    shapes = {tuple(x.shape) for x in jax.tree.leaves(abstract_params)}
    opt_leaves = jax.tree.leaves(abstract_opt)
    param_shaped = sum(math.prod(x.shape) * x.dtype.itemsize for x in opt_leaves if x.ndim and tuple(x.shape) in shapes)
    other = sum(math.prod(x.shape) * x.dtype.itemsize for x in opt_leaves) - param_shaped
    return param_shaped / sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params)), other


# --------------------------------------------------------------------------- zeroflax's placement
@dataclasses.dataclass(frozen=True)
class Setup:
    """The parallel layout and precision the zeroflax figures are for."""
    mesh: dict  # axis -> size, resolved (data, tensor, and pipe and sequence when present)
    devices_per_node: int
    precision: str = "fp32"
    persistence_threshold: int = 100_000
    logical_rules: tuple = ()

    @property
    def data(self) -> int:
        """ZeRO's N: the data axis, times the sequence axis (ZeRO partitions over both: sharding.mesh.zero_axes)."""
        return self.mesh[DATA_AXIS] * self.mesh.get(SEQUENCE_AXIS, 1)


def leaf_placements(spec: ModelSpec, setup: Setup, stored: bool = False):
    """(leaf, elements per device before ZeRO, partitioned over data?) per leaf, by the policy's rules; with
    `stored`, a fourth value: those elements as ZeRO stores them (padded to a multiple of the data size where
    it divides no free dimension: `sharding.padding`, which the 1/N of a partitioned leaf is of)."""
    from zeroflax.config import DEFAULT_LOGICAL_RULES
    from zeroflax.sharding.policy import logical_to_mesh_axes, zero_placement

    mesh = types.SimpleNamespace(shape=dict(setup.mesh), axis_names=tuple(setup.mesh))
    rules = setup.logical_rules or DEFAULT_LOGICAL_RULES
    pipe = setup.mesh.get(PIPE_AXIS, 1)
    out = []
    for leaf in spec.leaves:
        if leaf.names == ("flat",):  # a bare count: sliced by every model-parallel axis, always partitioned
            split = math.prod(size for axis, size in setup.mesh.items() if axis not in (DATA_AXIS, SEQUENCE_AXIS))
            out.append((leaf, leaf.size / split, setup.data > 1) + ((leaf.size / split,) if stored else ()))
            continue
        names = leaf.names or (None,) * len(leaf.shape)
        base = logical_to_mesh_axes(names, rules, mesh, "/".join(map(str, names)), leaf.shape)
        if leaf.stacked and pipe > 1:
            base = (PIPE_AXIS,) + tuple(base[1:])
        split = math.prod(setup.mesh[a] for a in base if a is not None)
        zero_dim, pad = zero_placement(leaf.shape, base, setup.data, setup.persistence_threshold, leaf.stacked)
        local = leaf.size / split
        padded = local if zero_dim is None else local * (leaf.shape[zero_dim] + pad) / leaf.shape[zero_dim]
        out.append((leaf, local, zero_dim is not None) + ((padded,) if stored else ()))
    return out


@dataclasses.dataclass
class States:
    """zeroflax's bytes per device for one (stage, offload) row; `host_*` live in host memory, `disk_*` in
    the NVMe offload's file."""
    stage: int
    offload: str
    device_params: float  # master weights in device memory
    device_opt: float
    compute_copy: float  # offload: the compute-dtype copy on the device
    host_params: float
    host_opt: float
    grad_buffer: float  # gradient buffer held from the backward pass to the update (device)
    other: float  # the optimizer's step counts, the step, rng and loss scale (replicated)
    # NVMe ('nvme' rows): the master weights and optimizer state (true elements, with the optimizer's step
    # counts) in the file, and the reduced gradient shards the step leaves on the device for the streamed
    # update (TrainState.pending_grads, stored shape).
    disk_params: float = 0.0
    disk_opt: float = 0.0
    pending_grads: float = 0.0

    @property
    def device_at_rest(self) -> float:
        return self.device_params + self.device_opt + self.compute_copy + self.pending_grads + self.other

    @property
    def disk_at_rest(self) -> float:
        return self.disk_params + self.disk_opt

    @property
    def host_at_rest(self) -> float:
        return self.host_params + self.host_opt

    @property
    def with_grads(self) -> float:
        return self.device_at_rest + self.grad_buffer


def zeroflax_states(spec: ModelSpec, setup: Setup, stage: int, offload: str = "none") -> States:
    """Model-state bytes per device under zeroflax's placement (module docstring)."""
    compute = PRECISION_BYTES[setup.precision]
    n = setup.data
    on_disk = offload == "nvme"
    optimizer_off = offload in ("optimizer", "optimizer+param", "nvme")
    param_off = offload == "optimizer+param"
    dev_p = dev_o = copy = host_p = host_o = grads = disk_p = disk_o = pending = 0.0
    for leaf, local, partitioned, padded in leaf_placements(spec, setup, stored=True):
        shard = padded / n if partitioned else local
        master = MASTER_BYTES * (shard if (stage == 3 or optimizer_off) else local)
        opt = spec.opt_bytes * (shard if stage >= 1 else local)
        if on_disk:
            # The file's records hold the true elements only (the padding stays zero and is never written):
            # this device's 1/N of the unpadded leaf, or the whole of one below the threshold.
            true = local / n if partitioned else local
            disk_p, disk_o = disk_p + MASTER_BYTES * true, disk_o + spec.opt_bytes * true
            pending += MASTER_BYTES * shard  # the gradient as reduced: partitioned (and padded) at stages 1-3
        elif optimizer_off:
            host_p, host_o = host_p + master, host_o + opt
        else:
            dev_p, dev_o = dev_p + master, dev_o + opt
        if optimizer_off and not (param_off and partitioned):  # offload_param: only persistent leaves keep a copy
            copy += compute * (shard if stage == 3 else local)
        grads += MASTER_BYTES * (shard if stage >= 2 else local)
    # step int32; rng uint32[2]; loss scale 4 x 4 B; the optimizer's step counts, which under 'nvme' are not
    # in the TrainState (its opt_state is None) but beside the records in the file.
    other = 4 + 8 + 16 + (0 if on_disk else spec.opt_other_bytes)
    disk_o += spec.opt_other_bytes if on_disk else 0
    return States(stage, offload, dev_p, dev_o, copy, host_p, host_o, grads, other, disk_p, disk_o, pending)


def host_buffer_bytes(spec: ModelSpec, setup: Setup, buffer_count: int, buffer_size: int) -> float:
    """The host memory of an 'nvme' row's stream, per process: `buffer_count` buffers of one chunk's record,
    a chunk being at most `buffer_size` elements of one device's shard of one leaf, so no bigger than the
    largest such shard (true elements), at (4 + K) bytes per element. (A chunk is at least one row of its
    shard, so a row longer than buffer_size makes it bigger; the records' 4 KiB alignment is left out.)"""
    largest = max((local / setup.data if partitioned else local
                   for _, local, partitioned in leaf_placements(spec, setup)), default=0.0)
    return buffer_count * min(buffer_size, math.ceil(largest)) * (MASTER_BYTES + spec.opt_bytes)


# --------------------------------------------------------------------------- the GPT's peak
_RESIDUALS: dict = {}


def _residual_bytes(gpt, seq: int, remat: str, compute_dtype: str, layers: int, micro_batch: int) -> int:
    """Bytes of the activations the GPT's forward keeps for its backward pass (one micro-batch, one device),
    read from `jax.vjp`'s residuals under an abstract trace (nothing runs); parameter-shaped residuals (the
    weights themselves) are not counted."""
    key = (repr(gpt), seq, remat, compute_dtype, layers, micro_batch)
    if key not in _RESIDUALS:
        import jax
        import jax.numpy as jnp

        from zeroflax.adapters import unbox
        from zeroflax.models.gpt import GPT, next_token_loss

        model = GPT(dataclasses.replace(gpt, num_layers=layers), remat=remat)
        params = unbox(jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]))[0]
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.dtype(compute_dtype)), params)
        loss = next_token_loss(model)
        batch = {"tokens": jax.ShapeDtypeStruct((micro_batch, seq + 1), jnp.int32)}
        residuals = jax.eval_shape(lambda p, b: jax.vjp(lambda q: loss(q, b, None), p)[1], params, batch)
        weights = [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(params)]
        total = 0
        for x in jax.tree.leaves(residuals):
            if (tuple(x.shape), x.dtype) in weights:
                weights.remove((tuple(x.shape), x.dtype))  # each weight once
            else:
                total += math.prod(x.shape) * x.dtype.itemsize
        _RESIDUALS[key] = total
    return _RESIDUALS[key]


def gpt_activations(gpt, seq: int, remat: str, precision: str, micro_batch: int) -> tuple[float, float]:
    """(saved, per layer): activation bytes one micro-batch keeps for the backward pass under `remat`, and
    what one layer's forward keeps under that policy.

    Every residual is a stacked [layers, batch, ...] array, a [batch, ...] array of the embedding and the
    head, or independent of both (a causal mask), so the bytes are bilinear in (layers, micro-batch):
    four traces of 1- and 2-layer models at micro-batches 1 and 2 give them exactly for any size."""
    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    b = {(l, m): _residual_bytes(gpt, seq, remat, dtype, l, m) for l in (1, 2) for m in (1, 2)}
    per_layer = lambda m: b[(2, m)] - b[(1, m)]
    layer = per_layer(1) + (per_layer(2) - per_layer(1)) * (micro_batch - 1)
    head = lambda m: b[(1, m)] - per_layer(m)
    head_bytes = head(1) + (head(2) - head(1)) * (micro_batch - 1)
    return head_bytes + gpt.num_layers * layer, layer


def gpt_peak(spec: ModelSpec, setup: Setup, states: States, train: dict) -> float | None:
    """The modeled peak of the step per device (device + host: what XLA:CPU's memory_analysis counts), or
    None where it is not modeled (a pipe axis larger than 1: the schedule decides what is in flight).

    arguments (states at rest, this device's batch rows; an 'nvme' row's `pending_grads` among them: the
      step's output of them reuses their donated buffer, so they count once)
      + gradients: the full local gradients, which exist before any reduction at stages 0-2 (stage 3
        reduce-scatters each layer's in the backward pass: a shard), and with accumulation the
        accumulator besides (full at stages 0-1, a shard at 2-3)
      + the activations kept for the backward pass (`gpt_activations`)
      + the layer the backward pass works on: under a remat policy its recomputed activations, what
        'none' would keep of one layer less what the policy kept.
    With a tensor axis of T the activations count 1/T: Megatron's slicing splits those of the heads, the
    MLP and the vocabulary, not the residual stream's, so this under-counts them (docs/plan.md).
    tests/test_estimate.py measures the error against memory_analysis; docs/plan.md has the figures."""
    if setup.mesh.get(PIPE_AXIS, 1) > 1 or setup.mesh.get(SEQUENCE_AXIS, 1) > 1:
        return None  # (a sequence axis: ring attention's tiles and Ulysses' head split are not modeled)
    tensor = setup.mesh.get(TENSOR_AXIS, 1)
    gpt, remat, micro, accum = spec.gpt, train["remat"], train["micro_batch"], train["accum"]
    full = sum(MASTER_BYTES * local for _, local, _ in leaf_placements(spec, setup))
    shard = states.grad_buffer if states.stage >= 2 else zeroflax_states(spec, setup, 2).grad_buffer
    grads = full if states.stage <= 2 else shard
    if accum > 1:
        grads += full if states.stage <= 1 else shard
    saved, layer = gpt_activations(gpt, train["seq"], remat, setup.precision, micro)
    working = 0.0 if remat == "none" else gpt_activations(gpt, train["seq"], "none", setup.precision, micro)[1] - layer
    batch = micro * accum * (train["seq"] + 1) * 4
    return states.device_at_rest + states.host_at_rest + batch + grads + (saved + working) / tensor


def row_config(config, stage: int, offload: str, *, nvme_path: str | None = None, **changes):
    """The Config of a table row: `config` at `stage` with `offload` ('none', 'optimizer', 'optimizer+param',
    'nvme') and `changes`, in one replace: the Config's checks see the row as a whole (a remat policy that the
    input's stage 3 refuses may be fine at the row's stage).

    'nvme' keeps the input's stream settings (buffer_count, buffer_size, io_threads, direct_io) and pin_memory
    and takes its directory from `nvme_path`, else the input's, else NVME_PLACEHOLDER (nothing here writes
    the file); the input's 'cpu' settings that 'nvme' refuses (update on the device, the delayed update) are
    not carried over, nor is an nvme_path into a 'cpu' row (which refuses one)."""
    from zeroflax.config import OffloadOptimizerConfig, OffloadParamConfig
    source = config.offload_optimizer
    if offload == "nvme":
        optimizer = OffloadOptimizerConfig(
            "nvme", pin_memory=source.pin_memory, nvme_path=nvme_path or source.nvme_path or NVME_PLACEHOLDER,
            buffer_count=source.buffer_count, buffer_size=source.buffer_size, io_threads=source.io_threads,
            direct_io=source.direct_io)
    elif offload != "none":
        optimizer = dataclasses.replace(source, device="cpu", nvme_path="")
    else:
        optimizer = OffloadOptimizerConfig(pin_memory=source.pin_memory)
    param = OffloadParamConfig("cpu", optimizer.pin_memory) if offload == "optimizer+param" else OffloadParamConfig()
    return config.replace(zero_stage=stage, offload_optimizer=optimizer, offload_param=param, **changes)


def _refusal(config, stage: int, offload: str) -> str | None:
    """Why the engine would refuse this row's configuration (the Config's own check), or None."""
    try:
        row_config(config, stage, offload)
    except ConfigError as error:
        return str(error).split("\n")[0]  # gin adds the configurable's name on further lines
    return None


# --------------------------------------------------------------------------- the table
def _deepspeed_row(spec: ModelSpec, devices: int, nodes: int, stage: int, offload: str, zero_init: bool,
                   buffer_factor: float) -> tuple[int, int] | None:
    """(GPU bytes per GPU, CPU bytes per node) of DeepSpeed's estimator, or None where it has none (stages 0
    and 1; NVMe: its estimators take no NVMe flag, and reading 'nvme' as CPU offload would put the disk's
    bytes in its CPU column)."""
    if offload == "nvme":
        return None
    if stage == 2:
        cpu, gpu = deepspeed_zero2(spec.num_params, devices, nodes, cpu_offload=offload != "none",
                                   additional_buffer_factor=buffer_factor)
        return gpu, cpu
    if stage == 3:
        cpu, gpu, _ = deepspeed_zero3(spec.num_params, spec.largest_layer_params, devices, nodes,
                                      cpu_offload=offload != "none", cpu_offload_params=offload == "optimizer+param",
                                      zero_init=zero_init, additional_buffer_factor=buffer_factor)
        return gpu, cpu
    return None


def estimate(spec: ModelSpec, setup: Setup, nodes: int = 1, *, zero_init: bool = True, buffer_factor: float = 1.5,
             train: dict | None = None, config=None) -> dict:
    """Every row of the table as a dict of bytes; `train` ({'micro_batch', 'seq', 'remat', 'accum'}) adds
    the batch and, for a GPT, the modeled peak; `config` (the job's Config) marks the rows it refuses, and
    its offload_optimizer's buffer_count and buffer_size size the 'nvme' rows' host buffers (else the
    defaults)."""
    from zeroflax.config import OffloadOptimizerConfig
    stream = config.offload_optimizer if config is not None else OffloadOptimizerConfig()
    rows = []
    for stage, offload in ROWS:
        states = zeroflax_states(spec, setup, stage, offload)
        ds = _deepspeed_row(spec, setup.devices_per_node, nodes, stage, offload, zero_init, buffer_factor)
        buffers = host_buffer_bytes(spec, setup, stream.buffer_count, stream.buffer_size) if offload == "nvme" else 0
        row = dict(stage=stage, offload=offload,
                   deepspeed_gpu=None if ds is None else ds[0], deepspeed_cpu_per_node=None if ds is None else ds[1],
                   device_at_rest=states.device_at_rest, device_with_grads=states.with_grads,
                   host_per_device=states.host_at_rest, host_per_node=states.host_at_rest * setup.devices_per_node,
                   disk_per_device=states.disk_at_rest, disk_per_node=states.disk_at_rest * setup.devices_per_node,
                   host_buffers=buffers, params=states.device_params, opt_state=states.device_opt,
                   compute_copy=states.compute_copy, pending_grads=states.pending_grads,
                   grad_buffer=states.grad_buffer, peak=None, peak_with_host=None, refused=None)
        if train is not None:
            batch = train["micro_batch"] * train["accum"] * (train["seq"] + 1) * 4  # int32 tokens
            row["batch"] = batch
            row["device_arguments"] = states.device_at_rest + batch
            row["arguments"] = states.device_at_rest + states.host_at_rest + batch
            row["refused"] = _refusal(config, stage, offload) if config is not None else (
                "Config.remat: 'none' is refused at stage 3" if stage == 3 and train["remat"] == "none" else None)
            if spec.gpt is not None and row["refused"] is None:
                # With host states: what XLA:CPU's memory_analysis counts; the table shows the device's part.
                row["peak_with_host"] = gpt_peak(spec, setup, states, train)
                if row["peak_with_host"] is not None:
                    row["peak"] = row["peak_with_host"] - states.host_at_rest
        rows.append(row)
    return dict(model=spec.name, num_params=spec.num_params, largest_layer_params=spec.largest_layer_params,
                devices_per_node=setup.devices_per_node, nodes=nodes, mesh=dict(setup.mesh), precision=setup.precision,
                persistence_threshold=setup.persistence_threshold, zero_init=zero_init, buffer_factor=buffer_factor,
                train=train, rows=rows, sources=SOURCES)


SOURCES = {
    "deepspeed_gpu": "DeepSpeed's estimate_zero2/zero3_model_states_mem_needs (stages 2 and 3 only): gpu_mem, "
                     "per GPU, model states with gradients and (stage 3) one gathered largest layer; none for the "
                     "'nvme' rows (DeepSpeed's estimators have no NVMe offload)",
    "deepspeed_cpu_per_node": "the same functions' cpu_mem, per node; none for the 'nvme' rows",
    "device_at_rest": "zeroflax's placement: parameters + optimizer state (+ compute copy under offload; + the "
                      "reduced fp32 gradient shard the 'nvme' update streams after the step) in device memory, per "
                      "device, between steps",
    "device_with_grads": "device_at_rest + the gradient buffer (fp32; full at stages 0-1, a shard at 2-3)",
    "host_per_device": "zeroflax's placement under offload: master weights + optimizer state in host memory, per "
                       "device (0 for 'nvme' rows: they are on disk)",
    "host_per_node": "host_per_device x devices per node",
    "disk_per_device": "'nvme' rows (OffloadOptimizerConfig.device 'nvme'): master weights + optimizer state in the "
                       "file, true elements (no padding), per device; a leaf below the persistence threshold whole. "
                       "Read once and written once per step",
    "disk_per_node": "disk_per_device x devices per node",
    "host_buffers": "'nvme' rows: the stream's host buffers per process, buffer_count x min(buffer_size, the "
                    "largest leaf shard) x (4 + K) bytes (OffloadOptimizerConfig of the gin config, else defaults)",
    "arguments": "gin configs: what compiled.memory_analysis().argument_size_in_bytes counts (device + host states, "
                 "this device's batch rows, an 'nvme' row's pending gradient shard included); on the CPU backend "
                 "host memory is device memory",
    "peak": "gin configs (GPT): arguments + gradient buffer + activations + gathered layers + update temporaries, "
            "an analytic model of memory_analysis' argument + output + temp - alias",
}

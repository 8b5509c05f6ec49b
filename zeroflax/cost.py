"""The cost model of `zeroflax plan`: predicted step time from bytes and FLOPs (docs/plan.md).

    time = collective bytes per device / bandwidth
         + host<->device bytes per device / host_bandwidth
         + disk bytes per device / disk_bandwidth   (NVMe offload: the state's file, read + written)
         + FLOPs per device / flops            (forward + backward + recomputation)
         + pipeline bubble: the compute term x (S - 1) / M with S stages and M micro-batches

Each term has two sources:
  - compiled: `measure(compiled, ...)`: collective bytes from the compiled HLO (`comm.parse_collectives`,
    loop trip counts and pipeline tick weights applied), FLOPs of every dot in the compiled HLO times the
    trip counts of the loops around it (`hlo_dot_flops`; `compiled.cost_analysis()` counts a loop body
    once, so it is not used), host transfers from the step's jaxpr (`comm.host_transfers`: XLA:CPU
    compiles them away);
  - analytic: `gpt_bound(...)`, a lower bound for a candidate not compiled: ZeRO's collectives leaf by
    leaf as the engine issues them (step/zero_sync.py, the ZeRO-3 gathers), Megatron's all-reduces
    over `tensor`, the stage sends over `pipe`, offload's transfers, and the matmul FLOPs of the GPT
    (elementwise work and recomputation the bound is not sure of are left out, so it stays below).

NVMe offload (`OffloadOptimizerConfig.device` 'nvme', offload 'nvme' here) moves nothing between host and
device inside the compiled program: after it, the gradient shards go down and the compute copy's chunks
come back, chunk by chunk, while the state's file is read once and written once ((4 + K) bytes per true
element of this device's partition, each way), and at stages 1-2 the new compute copy is all-gathered by a
program of its own. None of that is in the step's program, so both sources count it from the placement
(`nvme_traffic`; `nvme_outside` for a compiled engine): the same figures, the bound's from the unpadded
leaves.
"""
from __future__ import annotations

import dataclasses
import math
import re

from zeroflax.axes import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS
from zeroflax.config import RECOMPUTE_WHOLE
from zeroflax.comm import megatron_all_reduces
from zeroflax.hlo import computation_multipliers, scope_weight, split_computations

_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"^[a-z][a-z0-9]*\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(type_text: str) -> list[int]:
    found = _SHAPE.match(type_text)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def hlo_dot_flops(hlo_text: str, weights: dict | None = None) -> tuple[float, bool]:
    """(FLOPs of the dots of a compiled HLO module per step, whether a loop had no known trip count):
    2 x result elements x contracted elements per dot, times the runs of its computation (loop trip
    counts; `weights` as for comm.parse_collectives: pipeline tick branches)."""
    body, entry = split_computations(hlo_text)
    multiplier, unknown = computation_multipliers(body, entry)
    types = {}
    for lines in body.values():
        for line in lines:
            found = _DEF.match(line)
            if found:
                types[found.group(1)] = found.group(2)
    total = 0.0
    for name, times in multiplier.items():
        for line in body[name]:
            found = _DEF.match(line)
            if not found or found.group(3) != "dot":
                continue
            result, rest = found.group(2), found.group(4)
            lhs = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
            contracting = _CONTRACTING.search(rest)
            lhs_dims = _dims(types.get(lhs, ""))
            if contracting is None or not lhs_dims:
                continue
            inner = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
            total += times * scope_weight(rest, weights or {}) * 2 * math.prod(_dims(result)) * inner
    return total, unknown


# An NVMe SSD's sequential rate, about 2 GB/s each way for one PCIe 3 x4 drive (PCIe 4 drives do 5-7 GB/s),
# taken per device: one such drive per device, or a faster drive (or a RAID of several) that devices share.
# Reads and writes count together against it, as one drive serves both.
DISK_BANDWIDTH = 2e9


@dataclasses.dataclass(frozen=True)
class Rates:
    bandwidth: float  # collective bytes per second per device
    host_bandwidth: float  # host<->device bytes per second per device
    flops: float  # FLOP per second per device
    disk_bandwidth: float = DISK_BANDWIDTH  # NVMe offload's file: bytes read + written per second per device


@dataclasses.dataclass
class Cost:
    comm: float  # collective bytes per device per step
    host: float  # host<->device bytes per device per step
    flops: float  # FLOPs per device per step
    bubble: float = 0.0  # idle share factor: (S - 1) / M under a pipeline, else 0
    source: str = "analytic"
    disk: float = 0.0  # NVMe offload: the state's file, bytes read + written per device per step

    def seconds(self, rates: Rates) -> float:
        compute = self.flops / rates.flops
        return (self.comm / rates.bandwidth + self.host / rates.host_bandwidth + self.disk / rates.disk_bandwidth
                + compute * (1 + self.bubble))

    def parts(self, rates: Rates) -> dict:
        return dict(comm_s=self.comm / rates.bandwidth, host_s=self.host / rates.host_bandwidth,
                    compute_s=self.flops / rates.flops, bubble_s=self.flops / rates.flops * self.bubble,
                    disk_s=self.disk / rates.disk_bandwidth)


def nvme_traffic(true_elements: float, opt_bytes: float, compute_bytes: int) -> tuple[float, float]:
    """(host<->device bytes, disk bytes) per device per step of the NVMe update for `true_elements` of this
    device's partition: the fp32 gradient rows down and the compute copy's rows up (the chunks move their
    true elements only), and the file's records read once and written once: the master weights and the
    optimizer's parameter-shaped state (`opt_bytes` per element; Adam 8)."""
    from zeroflax.estimate import MASTER_BYTES
    return (MASTER_BYTES + compute_bytes) * true_elements, 2 * (MASTER_BYTES + opt_bytes) * true_elements


# ------------------------------------------------------------------------------------ analytic bound
def gpt_matmul_flops(gpt, seq: int, tokens: float, remat: str, pipe: int = 1, causal_skip: bool = False) -> float:
    """Matmul FLOPs of forward + backward (+ the recomputation the policy surely does) for `tokens` tokens.

    Forward: 2 x tokens x (per layer 3d^2 + d^2 + 2 d f, and the head d V) plus the attention's two
    einsums, 4 x tokens x seq x d per layer (dense attention only; a sparse layout does less, so none is
    counted). The backward pass is twice the forward. Recomputed in the backward pass: the attention
    einsums under 'dots_no_batch' (they have batch dimensions); under 'full' the layers' forward, of
    which the compiled step skips the last layer's (measured), so L - 1 layers are counted, and under a
    pipeline of S stages L - S (each stage's scan skips its last). A pipeline's backward tick also
    recomputes its stage's forward; that is not counted. `causal_skip`: the attention skips the masked half
    (ring attention's tiles, which a sequence axis may run), so half of it is counted."""
    d, f, layers = gpt.d_model, gpt.ff, gpt.num_layers
    matmul = 2 * tokens * (layers * (4 * d * d + 2 * d * f) + d * gpt.vocab_size)
    attention = layers * 4 * tokens * seq * d if gpt.attention in ("dense", "dot_product") else 0.0
    if causal_skip:
        attention /= 2
    forward = matmul + attention
    recompute = 0.0
    if remat in RECOMPUTE_WHOLE:
        per_layer = (2 * tokens * (4 * d * d + 2 * d * f) + attention / layers)
        recompute = max(layers - pipe, 0) * per_layer
    elif remat in ("dots_no_batch", "offload_dots_no_batch"):
        recompute = attention
    return 3 * forward + recompute


def gpt_bound(spec, setup, stage: int, offload: str, remat: str, micro_batch: int, accum: int, seq: int,
              global_batch: int) -> Cost:
    """A lower bound of the compiled step's cost per device (module docstring), from the placement
    (`estimate.leaf_placements`) and the GPT's shapes."""
    from zeroflax.config import DEFAULT_LOGICAL_RULES
    from zeroflax.estimate import MASTER_BYTES, PRECISION_BYTES, leaf_placements

    gpt = spec.gpt
    mesh = setup.mesh
    # ZeRO's N is data x sequence; a sequence axis of S gives each device 1/S of the tokens (attention's
    # collectives over it are left out: a lower bound).
    sequence = mesh.get(SEQUENCE_AXIS, 1)
    n, tensor, pipe = mesh[DATA_AXIS] * sequence, mesh.get(TENSOR_AXIS, 1), mesh.get(PIPE_AXIS, 1)
    compute = PRECISION_BYTES[setup.precision]
    share = (n - 1) / n
    optimizer_off = offload != "none"
    param_off = offload == "optimizer+param"
    comm = 0.0
    grads_to_host = copy_elements = streamed = true_elements = 0.0
    for leaf, local, partitioned in leaf_placements(spec, setup):
        if not partitioned:  # replicated over data: its gradient is all-reduced once per step
            comm += 2 * MASTER_BYTES * local * share
        elif stage == 0:
            comm += 2 * MASTER_BYTES * local * share
        elif stage in (1, 2):  # reduce-scatter(s), then the updated parameters all-gathered
            scatters = accum if stage == 2 else 1
            comm += (scatters * MASTER_BYTES + (compute if optimizer_off else MASTER_BYTES)) * local * share
        else:
            # The gradient is reduce-scattered per micro-batch. What must be gathered: a stacked layer's leaf
            # for each micro-batch's forward, and again for its backward only if it is a matrix (the input's
            # gradient needs it; XLA drops the backward gather of a bias or scale whose value the
            # recomputation does not need: measured on the tests' GPT); a leaf the model owns directly (the
            # embeddings) may be gathered once per step and kept (README; measured: the position embedding
            # is, at 4 micro-batches), so one gather per step.
            if leaf.stacked:
                gathers = accum * (2 if len(leaf.shape) > 2 else 1)
            else:
                gathers = 1
            comm += (accum * MASTER_BYTES + gathers * compute) * local * share
        shard = local / n if partitioned else local
        true_elements += shard
        grads_to_host += MASTER_BYTES * shard
        if param_off and partitioned:
            streamed += shard * (2 if leaf.stacked else 1)  # streamed where it is gathered
        else:
            copy_elements += shard  # the new compute copy comes back as shards (all-gathered on the device)
    host = disk = 0.0
    if offload == "nvme":  # after the program: gradients down, the copy up, the file read and written
        host, disk = nvme_traffic(true_elements, spec.opt_bytes, compute)
    elif optimizer_off:  # the update on the host: gradients down, the compute copy up, streamed shards
        host = grads_to_host + compute * copy_elements + accum * MASTER_BYTES * streamed
    activation = micro_batch * seq * gpt.d_model * compute / sequence  # one micro-batch's residual stream on one device
    if tensor > 1:
        vocab_parallel = dict(setup.logical_rules or DEFAULT_LOGICAL_RULES).get("vocab") == TENSOR_AXIS
        count = megatron_all_reduces(gpt.num_layers, pipe, 1, accum, remat, vocab_parallel)
        comm += count * 2 * activation * (tensor - 1) / tensor
    bubble = 0.0
    if pipe > 1:
        # Every micro-batch's activation crosses each of the S - 1 boundaries forward and its cotangent
        # backward: 2 M (S - 1) sends, spread over the S devices of the pipe.
        comm += 2 * accum * (pipe - 1) * activation / pipe
        bubble = (pipe - 1) / accum
    tokens = global_batch * seq / n
    flops = gpt_matmul_flops(gpt, seq, tokens, remat, pipe, causal_skip=sequence > 1) / (tensor * pipe)
    return Cost(comm, host, flops, bubble, "analytic", disk)


# ------------------------------------------------------------------------------------ compiled
def measure(engine, compiled, jaxpr=None) -> Cost:
    """The cost of a compiled step, read from the program (module docstring); with the state on disk, what
    its update moves after the program is added from the placement (`nvme_outside`)."""
    from zeroflax.comm import host_transfers, parse_collectives

    tables = engine.pipeline_tables()
    weights = tables.tick_weights() if tables is not None else None
    text = compiled.as_text()
    collectives, _ = parse_collectives(text, engine.mesh.size, dict(engine.mesh.shape), weights)
    flops, _ = hlo_dot_flops(text, weights)
    host = sum(host_transfers(jaxpr)) if jaxpr is not None and engine.plan.offload else 0.0
    bubble = engine.schedule.bubble_fraction() if engine.schedule is not None else 0.0
    # bubble_fraction is idle / all ticks = (S-1)/(M+S-1); the time factor on busy compute is (S-1)/M.
    factor = bubble / (1 - bubble) if bubble else 0.0
    comm, disk = sum(c.bytes_per_step for c in collectives), 0.0
    if engine.config.offload_optimizer.on_disk:
        gather, outside, disk = nvme_outside(engine)
        comm, host = comm + gather, host + outside
    return Cost(comm, host, flops, factor, "compiled", disk)


def nvme_outside(engine) -> tuple[float, float, float]:
    """(collective, host<->device, disk) bytes per device per step that an NVMe engine's update moves after
    its compiled program, from its plan: `nvme_traffic` of this device's true elements (per leaf: the leaf
    over its mesh slicing, and over ZeRO's N where partitioned; a leaf below the persistence threshold
    whole, per device, as the estimate and the bound count it, though a process's file holds it once),
    and at stages 1-2 the all-gather of the new compute copy over N as a ring moves it (result x (N - 1) / N,
    padding included, as comm.parse_collectives counts). K: the optimizer's parameter-shaped state per
    parameter (`estimate.opt_bytes`), as the bound takes it from the spec."""
    import jax
    import numpy as np

    from zeroflax.estimate import opt_bytes
    from zeroflax.sharding.policy import is_placement

    plan, mesh, n = engine.plan, dict(engine.mesh.shape), engine.zero_size
    compute = np.dtype(engine.config.compute_dtype).itemsize
    # A leaf's own mesh axes (tensor, pipe); an entry may name several axes.
    axes = lambda base: [a for entry in base if entry for a in (entry if isinstance(entry, tuple) else (entry,))]
    true_elements = gathered = 0.0
    for p in jax.tree.leaves(plan.placements, is_leaf=is_placement):
        split = math.prod(mesh[a] for a in axes(p.base))
        true_elements += math.prod(p.shape) / split / (n if p.zero_dim is not None else 1)
        if p.zero_dim is not None and engine.config.zero_stage in (1, 2):
            gathered += compute * math.prod(p.stored_shape) / split * (n - 1) / n
    host, disk = nvme_traffic(true_elements, opt_bytes(plan.abstract_params, plan.abstract_opt_state)[0], compute)
    return gathered, host, disk

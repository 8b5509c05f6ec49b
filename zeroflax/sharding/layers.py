"""ZeRO-3 "store one way, compute another": the gather, its handles, and scanned layers.

Inside the engine's loss (a `shard_map` that is manual over the `data` axis), a ZeRO-3 parameter is
its local shard. It reaches the model as a `ShardedLeaf` handle when the loss gathers it where it is
used: in a gather group (`sharding.groups`: Flax modules, `zeroflax.group` blocks), in `scan_layers`
(one layer's slice per loop iteration), or through `zeroflax.gather`; the engine gathers any other
leaf on entry. The gather (`gather_for_compute`):

  forward   cast the fp32 shard to the compute dtype, then all-gather (2 bytes/element in bf16), or
            with qwZ all-gather int8 blocks and their scales and dequantize on arrival
  backward  reduce-scatter the weight's cotangent in the gradient dtype (fp32)

It is a `custom_vjp`, so the reduction is a reduce-scatter by construction, not whatever the
partitioner infers, and it keeps no residual. No remat policy below saves the gathered weights
(they are not matmul outputs): the backward pass gathers again, as ZeRO-3 does, instead of holding
all layers' weights until the backward pass. (That is why `Config` refuses remat 'none' with
ZeRO-3: without rematerialisation every layer's gathered weights would be kept.) Inside a scan the
forward and backward loops are separate computations, so XLA cannot merge the two gathers; for
unscanned groups `sharding.groups` explains the ties that keep them apart.

Models call `scan_layers` for their stack of layers; outside the engine it is a plain (optionally
rematerialised) scan, so the same model code runs anywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from zeroflax.sharding.manual import on_slices
from zeroflax.sharding.scopes import LAYERS_SCOPE, SCOPE_END, ThreadStack


@dataclasses.dataclass
class GatherUsage:
    """What tracing the loss did with the ZeRO-3 handles: filled in while the engine traces it.

    gathered: leaf indices gathered at the point of use (groups, scans, `zeroflax.gather`).
    raw: leaf indices used as plain arrays without a gather (noted only by the engine's probe).
    groups: gather group name -> elements of its parameters (gathered together, dropped after use).
    remat_regions: how many checkpointed regions (groups, scanned layers) the loss has.
    failed: why the probe could not run the loss on handles (then every leaf is gathered on entry).
    layer_carry_bytes: bytes of the activation one scanned layer takes and returns, for one micro-batch
        on one device (the unit of the tensor axis's theory in the communication report); 0 if none.
    sequence_splits: how many activations the loss marks with `sequence_split` (sequence parallelism).
    scan_owners: Flax modules found running a lifted transform over shared (unstacked) parameters.
    group_calls: every group call in the order traced, with the handles (leaf indices) it gathers.
    """

    probe: bool = False
    gathered: set = dataclasses.field(default_factory=set)
    raw: set = dataclasses.field(default_factory=set)
    groups: dict = dataclasses.field(default_factory=dict)
    remat_regions: int = 0
    failed: str | None = None
    layer_carry_bytes: int = 0
    sequence_splits: int = 0
    scan_owners: set = dataclasses.field(default_factory=set)  # Flax module paths: see LayerContext
    group_calls: list = dataclasses.field(default_factory=list)  # (group name, elements, leaf indices) in order
    lifted_in_groups: int = 0  # Flax modules met inside a group but bound to another scope tree (nn.scan, nn.RNN)


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What the engine tells model code while it traces the loss."""

    remat: str  # one of config.REMAT_POLICIES
    bucket: int = 0  # Config.prefetch_bucket_size: a module with at most this many parameters is one group
    max_live: int = 0  # Config.max_live_parameters: 0 = no limit; else the next group is gathered early
    #                    (prefetched) only while this group and the next fit in it together
    usage: GatherUsage | None = None
    sequence_parallel: bool = False  # Config.sequence_parallel: see sharding.tensor
    tensor_size: int = 1  # the tensor axis's size
    logical_rules: tuple = ()  # Config.logical_rules: logical axis name -> mesh axis
    data_axis_aliases: tuple = ()  # Config.data_axis_aliases: a model's pmap-era axis names for the data axis
    data_axis: str = "data"
    # Paths of Flax modules that run a lifted transform (nn.scan, nn.RNN) over modules sharing their
    # parameters at every step (a recurrent cell): found by the probe, each is one gather group whatever
    # its size, so the cell is gathered once per pass rather than once per step.
    scan_owners: frozenset = frozenset()


_contexts = ThreadStack()  # of LayerContext: the engine's, while it traces the loss


def layer_context(ctx: LayerContext):
    """A context manager: model code traced inside it (in this thread) sees `ctx` as `current_context()`."""
    return _contexts.push(ctx)


def current_context() -> LayerContext | None:
    return _contexts.top()


def current_usage() -> GatherUsage | None:
    ctx = current_context()
    return ctx.usage if ctx is not None else None


def all_gather_exact(x, dim: int, axis: str):
    """A tiled all-gather of x along `dim` over mesh axis `axis` that moves x's own bytes.

    16-bit floats travel as uint16: bit-exact, and the CPU backend would otherwise widen bf16/fp16
    collectives to fp32 (doubling the bytes); GPUs carry them as they are."""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        gathered = jax.lax.all_gather(bits, axis, axis=dim, tiled=True)
        return jax.lax.bitcast_convert_type(gathered, x.dtype)
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def quantize_blocks(x, block: int):
    """int8 blocks of `block` consecutive elements of x (flattened), one scale (max |x| / 127) per block.

    Returns (q int8 [blocks, block], scale float32 [blocks]); the last block is zero-padded.
    """
    flat = x.astype(jnp.float32).ravel()
    pad = (-flat.size) % block
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, block)
    amax = jnp.max(jnp.abs(blocks), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_blocks(q, scale, shape, dtype):
    """The inverse of `quantize_blocks` (up to rounding): an array of `shape` in `dtype`."""
    flat = (q.astype(jnp.float32) * scale[..., None]).reshape(q.shape[:-2] + (-1,))
    size = math.prod(shape)
    return flat[..., :size].reshape(q.shape[:-2] + tuple(shape)).astype(dtype)


def _quantized_all_gather(shard, dim: int, axis: str, compute_dtype, block: int):
    """ZeRO++ qwZ: all-gather int8 blocks and their scales, dequantize on arrival to `compute_dtype`.

    The scales travel in the compute dtype's width when it is 16-bit (as uint16 bits), so a block of
    256 costs 258 bytes instead of 512 in bf16. A shard smaller than a block is one block of its size."""
    q, scale = quantize_blocks(shard, max(1, min(block, shard.size)))
    if jnp.dtype(compute_dtype).itemsize == 2:
        scale = scale.astype(compute_dtype)
    q_all = jax.lax.all_gather(q, axis, axis=0, tiled=False)  # [N, blocks, block]
    scale_all = all_gather_exact(scale[None], 0, axis)  # [N, blocks]
    parts = dequantize_blocks(q_all, scale_all.astype(jnp.float32), shard.shape, compute_dtype)  # [N, *shard]
    # The N shards side by side along `dim`, as a tiled all-gather would have put them.
    parts = jnp.moveaxis(parts, 0, dim)
    shape = list(shard.shape)
    shape[dim] *= parts.shape[dim]
    return parts.reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def gather_for_compute(shard, dim: int, axis: str, compute_dtype, quant_block: int = 0, sliced: tuple = ()):
    """All-gather a ZeRO-3 shard along `dim` over mesh axis `axis`, in `compute_dtype`.

    quant_block > 0: ZeRO++'s quantized weights (qwZ): int8 blocks of that many elements travel
    instead of the compute dtype; the gradient is the reduce-scatter of the cotangent either way.
    sliced: the automatic mesh axis (tensor) slicing each dimension, or None: the gather and its
    reduce-scatter move this device's tensor slice only (`sharding.manual`).
    """
    return on_slices(lambda s: _gather_shard(s, dim, axis, compute_dtype, quant_block), shard, sliced)


def _gather_shard(shard, dim: int, axis: str, compute_dtype, quant_block: int):
    if quant_block:
        return _quantized_all_gather(shard, dim, axis, compute_dtype, quant_block)
    return all_gather_exact(shard.astype(compute_dtype), dim, axis)


def _gather_fwd(shard, dim, axis, compute_dtype, quant_block, sliced):
    # The only residual is a zero-size array carrying the master dtype for the backward cast.
    return gather_for_compute(shard, dim, axis, compute_dtype, quant_block, sliced), jnp.zeros((0,), shard.dtype)


def _gather_bwd(dim, axis, compute_dtype, quant_block, sliced, dtype_carrier, cotangent):
    scatter = lambda c: jax.lax.psum_scatter(c.astype(dtype_carrier.dtype), axis, scatter_dimension=dim, tiled=True)
    return (on_slices(scatter, cotangent, sliced),)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)


def in_host_memory(x) -> bool:
    """Whether x (an array or tracer) is typed as living in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def gather_from_host(sink, source, dim: int, axis: str, compute_dtype, quant_block: int = 0, sliced: tuple = ()):
    """`gather_for_compute` of a shard held in host memory (ZeRO-3 with `offload_param`).

    `source`, this device's shard of the master weights on the host, comes to the device and is
    gathered there. Its gradient (the reduce-scatter) is `sink`'s: a device array of the shard's shape
    that the forward pass never reads, so gradients stay on the device, like every other leaf's, and
    reach the host once per step with them rather than once per layer and micro-batch.
    """
    del sink
    # Per tensor slice: each device streams only its own slice of the shard.
    stream = lambda s: _gather_shard(jax.device_put(s, jax.memory.Space.Device), dim, axis, compute_dtype, quant_block)
    return on_slices(stream, source, sliced)


def _from_host_fwd(sink, source, dim, axis, compute_dtype, quant_block, sliced):
    out = gather_from_host(sink, source, dim, axis, compute_dtype, quant_block, sliced)
    return out, jnp.zeros((0,), sink.dtype)


def _from_host_bwd(dim, axis, compute_dtype, quant_block, sliced, dtype_carrier, cotangent):
    (grad,) = _gather_bwd(dim, axis, compute_dtype, quant_block, sliced, dtype_carrier, cotangent)
    return grad, None


gather_from_host.defvjp(_from_host_fwd, _from_host_bwd)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class ShardedLeaf:
    """A ZeRO-3 parameter still in its at-rest form: this device's shard, gathered where it is used.

    `dim` is the partitioned dimension of one gathered array. For a stacked-layer leaf that is the
    stacked leaf's dimension minus one: slicing the handle (as `lax.scan` or `nn.scan` does) keeps it a
    handle, and each layer's slice is gathered on its own. `shape` is the whole (gathered) shape of one
    slice; `index` is the leaf's position in the flattened parameters (for the engine's bookkeeping);
    `sliced` names the automatic mesh axis (tensor) slicing each dimension of one slice, or None.
    With `source` (offload_param), the shard lives on the host and `shard` is its device gradient
    sink (see `gather_from_host`).
    """

    shard: Any
    dim: int
    axis: str
    compute_dtype: Any
    shape: tuple
    index: int = -1
    quant_block: int = 0
    sliced: tuple = ()
    source: Any = None

    def tree_flatten(self):
        if _shape_views:  # a model's own shape checks are looking: one leaf of the gathered shape
            return (GlobalShapeView(self),), None
        return (self.shard, self.source), (self.dim, self.axis, self.compute_dtype, self.shape, self.index, self.quant_block,
                               self.sliced)

    @classmethod
    def tree_unflatten(cls, aux, children):
        if aux is None:  # flattened as a view (a tree map that kept the leaf gives the view back)
            view = children[0]
            return view.handle if isinstance(view, GlobalShapeView) else view
        return cls(children[0], *aux, source=children[1])

    @property
    def global_shape(self) -> tuple:
        """The shape the model declared: the gathered shape, after the layer dimensions of a stack."""
        extra = getattr(self.shard, "ndim", len(self.shape)) - len(self.shape)
        return tuple(self.shard.shape[:extra]) + tuple(self.shape)

    @property
    def stacked(self) -> bool:
        """Still a stack of layers (not yet sliced to one layer by a scan)."""
        return getattr(self.shard, "ndim", len(self.shape)) > len(self.shape)

    @property
    def size(self) -> int:
        """Elements of the gathered array (of one layer, for a stack)."""
        return math.prod(self.shape)

    @property
    def dtype(self):
        return self.compute_dtype

    def gather(self):
        if self.stacked:
            raise TypeError("a stack of layers held ZeRO-3 sharded cannot be gathered whole; iterate over "
                            "its layers with zeroflax.scan_layers or nn.scan")
        usage = current_usage()
        if usage is not None:
            usage.gathered.add(self.index)
        return self._gathered()

    def _gathered(self):
        if self.source is not None:
            return gather_from_host(self.shard, self.source, self.dim, self.axis, self.compute_dtype,
                                    self.quant_block, self.sliced)
        return gather_for_compute(self.shard, self.dim, self.axis, self.compute_dtype, self.quant_block, self.sliced)

    def __jax_array__(self):
        usage = current_usage()
        if usage is not None and usage.probe:  # the engine's probe: note the raw use, keep tracing
            usage.raw.add(self.index)
            return self._gathered()
        raise TypeError(
            "this parameter is held ZeRO-3 sharded; gather it where it is used with zeroflax.gather(...), run "
            "its module as a gather group (Flax modules are, automatically) or iterate over a stack of layers "
            "with zeroflax.scan_layers")

    # Model code also uses a parameter as an array in ways that do not go through __jax_array__: a tied
    # head's `embedding.T` (transformers' FlaxGPT2LMHeadModel), indexing, `x @ w`, `w.astype(...)`. Each is
    # a raw use: the probe notes it (the step then gathers that leaf on entry, and the memory report
    # names it), so one such use never makes the whole model fall back to gathering everything.
    def __getitem__(self, index):
        return self.__jax_array__()[index]

    @property
    def T(self):
        return self.__jax_array__().T

    @property
    def mT(self):
        return self.__jax_array__().mT

    @property
    def ndim(self) -> int:
        return len(self.global_shape)


def _raw_method(name):
    def method(self, *args, **kwargs):
        return getattr(self.__jax_array__(), name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in ("reshape", "astype", "transpose", "swapaxes", "squeeze", "ravel", "flatten", "sum", "mean", "max",
              "min", "take", "dot", "conj", "clip", "__matmul__", "__rmatmul__", "__add__", "__radd__", "__sub__",
              "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__", "__pow__", "__neg__", "__pos__"):
    setattr(ShardedLeaf, _name, _raw_method(_name))


_shape_views = ThreadStack()  # not empty inside `global_shape_view()`


@dataclasses.dataclass(frozen=True)
class GlobalShapeView:
    """What a ZeRO-3 handle flattens to inside `global_shape_view()`: a leaf with the declared (gathered)
    shape and the compute dtype, for code that checks shapes of the parameters it is handed."""

    handle: ShardedLeaf

    @property
    def shape(self) -> tuple:
        return self.handle.global_shape

    @property
    def dtype(self):
        return self.handle.compute_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


@contextlib.contextmanager
def global_shape_view():
    """While active, ZeRO-3 handles flatten to one `GlobalShapeView` leaf each (and come back whole from
    a tree map that keeps it). Flax's `Scope.param` compares `np.shape` of an existing parameter's
    leaves with its initializer's shape; in a module's `setup()`, which Flax runs before any method
    interceptor, the parameter is still a handle, and its shard's shape would fail that check."""
    with _shape_views.push(True):
        yield


def reused_leaves(group_calls, max_reuse_distance: int) -> dict:
    """Leaves gathered by more than one group call that stay within reuse distance: leaf index -> how
    many calls use it. A leaf qualifies when fewer than `max_reuse_distance` parameter elements are
    gathered by the other calls between any two of its uses (DeepSpeed's stage3_max_reuse_distance)."""
    uses: dict = {}
    for position, (_, _, leaves) in enumerate(group_calls):
        for index in leaves:
            uses.setdefault(index, []).append(position)
    kept = {}
    for index, positions in uses.items():
        if len(positions) < 2:
            continue
        gaps = [sum(size for _, size, _ in group_calls[a + 1:b]) for a, b in zip(positions, positions[1:])]
        if max(gaps) < max_reuse_distance:
            kept[index] = len(positions)
    return kept


def is_handle(x) -> bool:
    return isinstance(x, ShardedLeaf)


def gather(tree):
    """Make ZeRO-3 parameters whole on this device, in the compute dtype, at the point of use.

    `tree` is one parameter or any pytree of them; leaves that are not ZeRO-3 handles (replicated
    parameters, activations, anything outside the engine) pass through unchanged. The backward pass
    reduce-scatters the gradient. Call it inside a `zeroflax.group` (or a Flax module, which is one)
    for the gathered weights to be dropped after use and gathered again for the backward pass.
    """
    return jax.tree.map(lambda x: x.gather() if is_handle(x) else x, tree, is_leaf=is_handle)


def gather_layer(layer_params):
    """Make one layer's parameters whole on this device (identity for leaves that already are)."""
    return gather(layer_params)


def remat_policy(name: str):
    """The jax.checkpoint policy for a named remat setting; None means no checkpointing.

    None of them saves ZeRO-3's gathered weights (they are not matmul outputs), so the backward pass
    gathers them again. ('none' under ZeRO-3 is refused by Config: saving everything would keep them.)
    """
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    return {
        "full": policies.nothing_saveable,
        "dots": policies.dots_saveable,
        "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
        # MaxText's activation offload: what 'dots_no_batch' saves goes to host memory instead.
        "offload_dots_no_batch": policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
    }[name]


# The name of the values between checkpointed blocks (a group's or a scanned layer's inputs and outputs).
BOUNDARY = "zeroflax_boundary"


def _stack_length(stacked_params) -> int:
    """The number of layers in a stack: the leading dimension of its leaves (handles included)."""
    for leaf in jax.tree.leaves(stacked_params, is_leaf=is_handle):
        shape = getattr(leaf.shard if is_handle(leaf) else leaf, "shape", None)  # a handle's shape is one slice's
        if shape:
            return int(shape[0])
    return 0



def mark_boundary(tree):
    """`tree` with its floating arrays named as block boundaries, which `loss_remat_policy` saves."""
    def mark(x):
        return checkpoint_name(x, BOUNDARY) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) else x
    return jax.tree.map(mark, tree)


def loss_remat_policy(name: str):
    """The policy for the loss as a whole (code between blocks: a model's stem, pooling, head and loss):
    it keeps the block boundaries and what the blocks' own policy keeps, and recomputes the rest in the
    backward pass. The blocks are not run again by it: their outputs and residuals are saved."""
    policy = remat_policy(name)
    if policy is None:
        return None
    boundary = jax.checkpoint_policies.save_only_these_names(BOUNDARY)

    # Boundaries are saved on the device; anything else as the block policy says (an offloading
    # policy answers with an Offloadable, which save_from_both_policies would refuse).
    def keep_boundaries(prim, *args, **params):
        return True if boundary(prim, *args, **params) else policy(prim, *args, **params)
    return keep_boundaries


_layer_runners = ThreadStack()  # of runners: see layer_runner


def layer_runner(runner: Callable):
    """A context manager: while it is active (in this thread), `scan_layers` hands its loop to
    `runner(run, carry, stacked_params, xs)` instead of calling `run(carry, stacked_params, xs)`, where
    `run` is the (rematerialised) scan over the layers it is given. The pipeline's stage hook
    (`pipeline.executor.stage_hook`) installs one that runs only its stage's chunk of the layers."""
    return _layer_runners.push(runner)


def scan_layers(body: Callable, carry, stacked_params, xs=None, *, remat: str | None = None, unroll: int = 1):
    """Run `body` over a stack of layers: `carry = body(carry, layer_params[, x])` for each layer.

    `stacked_params` is a pytree whose leaves have the layers as leading dimension. Under the engine,
    ZeRO-3 layers are gathered one at a time inside the loop and the body is rematerialised with the
    configured policy (`Config.remat`); `remat` overrides the policy (use it outside the engine).
    Returns the final carry.
    """
    ctx = current_context()
    name = remat if remat is not None else (ctx.remat if ctx is not None else "none")
    policy = remat_policy(name)

    def step(carry, inputs):
        layer, x = inputs
        layer = gather_layer(layer)
        out = body(carry, layer) if xs is None else body(carry, layer, x)
        return out, None

    if policy is not None:
        checkpointed = jax.checkpoint(step, policy=policy, prevent_cse=False)
        # The per-layer carries are the scan's residuals: named, the loss's own policy keeps them too.
        step = lambda carry, inputs: checkpointed(mark_boundary(carry), inputs)
        if ctx is not None and ctx.usage is not None:
            ctx.usage.remat_regions += 1

    def run(carry, stacked_params, xs):
        # The scope marks the scan in the HLO's metadata, where the memory explainer finds the layers.
        with jax.named_scope(f"{LAYERS_SCOPE}{_stack_length(stacked_params)}{SCOPE_END}"):
            return jax.lax.scan(step, carry, (stacked_params, xs), unroll=unroll)[0]

    if ctx is not None and ctx.usage is not None:
        ctx.usage.layer_carry_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(carry))

    runner = _layer_runners.top()  # under a pipeline: only this stage's chunk of the layers, on its input
    if runner is not None:
        return mark_boundary(runner(run, carry, stacked_params, xs))
    return mark_boundary(run(carry, stacked_params, xs))

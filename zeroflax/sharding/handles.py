"""The ZeRO-3 handle: a parameter still in its at-rest form (this device's shard) as the model receives it.

The engine hands the loss a `ShardedLeaf` for each ZeRO-3 parameter it gathers at the point of use:
in a gather group (`sharding.groups`: Flax modules, `zeroflax.group` blocks), in `scan_layers` (one
layer's slice per loop iteration), or through `zeroflax.gather`; the engine gathers any other leaf on
entry. The handle's array protocol makes every other use of it as an array a raw use, which the
engine's probe notes (that leaf is then gathered on entry) and which otherwise fails with a message
saying where to gather it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax

from zeroflax.sharding.collectives import gather_for_compute, gather_from_host
from zeroflax.sharding.context import current_usage
from zeroflax.sharding.scopes import ThreadStack


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
    sink (see `gather_from_host`). `pad`: the stored leaf's padding along `dim`, which the gather cuts
    off (`sharding.padding`).
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
    pad: int = 0

    def tree_flatten(self):
        if _shape_views:  # a model's own shape checks are looking: one leaf of the gathered shape
            return (GlobalShapeView(self),), None
        return (self.shard, self.source), (self.dim, self.axis, self.compute_dtype, self.shape, self.index, self.quant_block,
                               self.sliced, self.pad)

    @classmethod
    def tree_unflatten(cls, aux, children):
        if aux is None:  # flattened as a view (a tree map that kept the leaf gives the view back)
            view = children[0]
            return view.handle if isinstance(view, GlobalShapeView) else view
        return cls(children[0], *aux[:-1], source=children[1], pad=aux[-1])

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
                                    self.quant_block, self.sliced, self.pad)
        return gather_for_compute(self.shard, self.dim, self.axis, self.compute_dtype, self.quant_block, self.sliced,
                                  self.pad)

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

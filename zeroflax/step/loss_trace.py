"""The user's loss as the step traces it: on compute-dtype parameters (ZeRO-3 handles where the loss
gathers them itself), under the loss scope, with Config.remat; and the probe that finds out, before the
step is first traced, which ZeRO-3 leaves the loss gathers itself (docs/zero3.md)."""
from __future__ import annotations

import re
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroflax.config import Config, ConfigError
from zeroflax.pipeline.executor import active_stage
from zeroflax.sharding.context import GatherUsage, LayerContext, reused_leaves
from zeroflax.sharding.handles import ShardedLeaf
from zeroflax.sharding.linen_groups import loss_scope
from zeroflax.sharding.mesh import DATA_AXIS, TENSOR_AXIS, sequence_size
from zeroflax.sharding.policy import LeafPlacement, ShardingPlan, is_placement
from zeroflax.sharding.relocate import gathered_on_entry, relocated
from zeroflax.sharding.remat import loss_remat_policy


def floats_to(tree, dtype):
    """Floating-point leaves cast to `dtype` (the compute dtype); integer leaves (tokens, labels) kept."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _split_loss_output(out):
    if isinstance(out, tuple) and len(out) == 2:
        return out
    return out, None


class LossTrace:
    """How the step calls the loss; holds what the probe found (`probe_usage`) and what the last trace of
    the step did (`gather_usage`: groups, regions)."""

    def __init__(self, loss_fn: Callable, config: Config, plan: ShardingPlan, manual_axes: frozenset,
                 has_model_state: bool):
        self.loss_fn, self.config, self.plan = loss_fn, config, plan
        self.mesh = plan.mesh
        self.manual_axes = manual_axes
        self.has_model_state = has_model_state
        self.remat = config.remat  # the policy the step runs (remat_choice.py may settle it to 'none')
        self.probe_usage: GatherUsage | None = None
        self.gather_usage: GatherUsage | None = None

    # ------------------------------------------------------------------------------ the loss
    def call(self, params, batch, rng, model_state):
        """(loss, aux, new model state) of the user's loss on one micro-batch."""
        if self.has_model_state:
            out, new_state = self.loss_fn(params, batch, rng, model_state)
        else:
            out, new_state = self.loss_fn(params, batch, rng), None
        loss, aux = _split_loss_output(out)
        return loss, aux, new_state

    def params_for_compute(self, params, point_of_use: set, sources=None, at_use=None):
        """Inside shard_map: turn at-rest parameters into what the loss sees (compute dtype).

        At ZeRO-3 a partitioned leaf reaches the loss as a `ShardedLeaf` handle when it is gathered
        where it is used (`point_of_use`: leaf indices, and every stack of layers); any other leaf is
        gathered here, on entry. `sources` (offload_param; flattened, None where not streamed) are the
        host shards that the gathers stream, `params` holding their device gradient sinks. `at_use`: a dict
        that gets the handle of each leaf whose entry gather is marked to be moved to its uses
        (`relocated_leaves`; `sharding.relocate`), or None.
        """
        config = self.config
        dtype = config.compute_dtype
        stage3 = config.zero_stage == 3
        block = config.quantization_block if config.quantized_weights else 0
        placements = jax.tree.leaves(self.plan.placements, is_leaf=is_placement)
        leaves, treedef = jax.tree.flatten(params)
        sources = sources or [None] * len(leaves)
        relocated = self.relocated_leaves() if at_use is not None else frozenset()  # once, not per leaf

        def prepare(index, placement: LeafPlacement, leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf
            if stage3 and placement.zero_dim is not None:
                first = 1 if placement.stacked else 0  # a stack's handle describes one layer
                dim, sliced = placement.zero_dim - first, placement.auto_spec()[first:]
                handle = ShardedLeaf(leaf, dim, placement.zero_axis, dtype, tuple(placement.shape[first:]), index, block,
                                     sliced, sources[index], placement.pad)
                if placement.stacked or index in point_of_use:
                    return handle
                if index in relocated:
                    at_use[index] = handle
                    return gathered_on_entry(handle, index)
                return handle._gathered()
            return leaf.astype(dtype)

        return jax.tree.unflatten(treedef, [prepare(i, p, x) for i, (p, x) in enumerate(zip(placements, leaves))])

    def context(self, usage: GatherUsage, scan_owners: frozenset | None = None) -> LayerContext:
        """The context the loss is traced in; `scan_owners` defaults to what the probe found."""
        config = self.config
        probed = self.probe_usage.scan_owners if self.probe_usage is not None else ()
        owners = frozenset(probed) if scan_owners is None else scan_owners
        return LayerContext(remat=self.remat, bucket=config.prefetch_bucket_size,
                            max_live=config.max_live_parameters, usage=usage,
                            sequence_parallel=config.sequence_parallel, tensor_size=self.mesh.shape.get(TENSOR_AXIS, 1),
                            sequence_size=sequence_size(self.mesh), sequence_attention=config.sequence_attention,
                            logical_rules=config.logical_rules, data_axis_aliases=config.data_axis_aliases,
                            data_axis=DATA_AXIS, scan_owners=owners)

    def start(self) -> tuple[LayerContext, set]:
        """A new trace of the step: its context (recording into `gather_usage`) and the point-of-use leaves."""
        self.gather_usage = GatherUsage()
        return self.context(self.gather_usage), self.point_of_use()

    def traced(self, ctx: LayerContext, point_of_use: set, params, batch, rng, model_state, sources=None):
        """The user's loss as the engine traces it (inside shard_map): under the loss scope (context,
        Linen groups), on compute-dtype parameters (handles for `point_of_use`) and batch; the leaves of
        `relocated_leaves` gathered at each of their uses (`sharding.relocate`)."""
        relocate = bool(self.relocated_leaves()) and not ctx.usage.probe and sources is None

        def loss(params, batch, rng, model_state):
            ctx.usage.loss_traces += 1
            with loss_scope(ctx):
                if not relocate:
                    return self.call(self.params_for_compute(params, point_of_use, sources),
                                     floats_to(batch, self.config.compute_dtype), rng, model_state)
                at_use: dict = {}
                marked = lambda p, b, r, m: self.call(self.params_for_compute(p, point_of_use, None, at_use), b, r, m)
                return relocated(marked, at_use, self.leaf_paths(), self.kept_leaves())(
                    params, floats_to(batch, self.config.compute_dtype), rng, model_state)

        policy = loss_remat_policy(ctx.remat)
        probe = self.probe_usage
        # Under a pipeline a stage's backward recomputes the stage anyway (and its output leaves the
        # loss through the stage hook, which a checkpoint would not let it do). A loss the probe could not
        # run is placed by the program (`sharding.relocate`), each use and each scanned layer with its own
        # remat: the loss's policy, which keeps every group's output, would keep them for every layer too
        # (an nn.scan of Dense modules: 3.7x the temporaries).
        if (policy is None or ctx.usage.probe or probe is None or not probe.remat_regions
                or (probe.failed and self.can_relocate())
                or active_stage() is not None):
            return loss(params, batch, rng, model_state)
        # Config.remat reaches the code between the checkpointed blocks too (a stem, pooling, the head
        # and the loss): only the blocks' boundaries are kept from it. prevent_cse: without the barrier
        # XLA merges that recomputation with the forward pass (ResNet-18 at 224^2, 8 per device, stage 0,
        # remat 'full': 235.6 MiB of temporaries without the barrier, 214.2 MiB with it; 384.9 MiB
        # with remat 'none').
        return jax.checkpoint(loss, policy=policy, prevent_cse=True)(params, batch, rng, model_state)

    def gradient_sinks(self, params):
        """(params, sources): with offload_param, each streamed leaf (a host shard) is replaced by a
        device array of its shape that receives its gradient, and listed in `sources` (flattened, None
        elsewhere); without it, (params, None)."""
        streamed = self.plan.streamed()
        if not any(streamed):
            return params, None
        leaves, treedef = jax.tree.flatten(params)
        sinks = [jnp.zeros(x.shape, x.dtype) if s else x for x, s in zip(leaves, streamed)]
        return treedef.unflatten(sinks), [x if s else None for x, s in zip(leaves, streamed)]

    # ---------------------------------------------------------------------------- the probe
    def can_relocate(self) -> bool:
        """Whether gathers on entry can be moved to the uses (`sharding.relocate`): at stage 3, not under a
        pipeline (a stage's loss is its own trace) nor with offload_param (its gathers stream from the host)."""
        return self.config.zero_stage == 3 and active_stage() is None and not any(self.plan.streamed())

    def relocated_leaves(self) -> frozenset:
        """The ZeRO-3 leaves gathered at each of their uses (`sharding.relocate`) instead of on entry: those
        the loss uses as plain arrays (a tied head's `wte.T`, `x @ w`), and every one when the loss cannot
        run on handles at all (a plain `lax.scan` over a dict of stacked arrays: each iteration then
        gathers its own slice)."""
        usage = self.probe_usage
        if usage is None or not self.can_relocate():
            return frozenset()
        if usage.failed:
            return frozenset(range(len(jax.tree.leaves(self.plan.placements, is_leaf=is_placement))))
        return frozenset(usage.raw) | self.kept_leaves()

    def kept_leaves(self) -> frozenset:
        """The ZeRO-3 leaves that several groups share within Config.max_reuse_distance (a shared
        embedding, a Linen module's `__call__` and `attend`): the placement pass gathers each at its first
        use and keeps it for the later ones (DeepSpeed's meaning of the key), never on entry. A leaf also
        used as a plain array is gathered at each use instead: the probe does not see where such a use falls
        among the groups."""
        usage = self.probe_usage
        if usage is None or usage.failed or not self.can_relocate():
            return frozenset()
        return frozenset(reused_leaves(usage.group_calls, self.config.max_reuse_distance)) - frozenset(usage.raw)

    def leaf_paths(self) -> dict[int, str]:
        """Leaf index -> its path as `layers/w_in` (a group's name in the HLO's metadata ends at a `]`)."""
        paths = jax.tree_util.tree_flatten_with_path(self.plan.placements, is_leaf=is_placement)[0]
        return {i: jax.tree_util.keystr(path, simple=True, separator="/") for i, (path, _) in enumerate(paths)}

    def point_of_use(self) -> set:
        usage = self.probe_usage
        if usage is None or usage.failed:
            return set()
        return usage.gathered - usage.raw - set(reused_leaves(usage.group_calls, self.config.max_reuse_distance))

    def gathered_on_entry_reasons(self) -> dict[str, str]:
        """Path -> why of each ZeRO-3 partitioned leaf gathered on entry rather than where it is used."""
        usage, point_of_use = self.probe_usage, self.point_of_use()
        reused = reused_leaves(usage.group_calls, self.config.max_reuse_distance) if usage else {}
        paths = jax.tree_util.tree_flatten_with_path(self.plan.placements, is_leaf=is_placement)[0]
        reasons = {}
        for index, (path, placement) in enumerate(paths):
            if placement.zero_dim is None or placement.stacked or index in point_of_use:
                continue
            if index in self.relocated_leaves():  # gathered at each use, where the step meets it
                continue
            if usage is None or usage.failed:
                why = f"the loss cannot run on handles ({usage.failed if usage else 'not traced yet'})"
            elif index in usage.raw:
                why = "used as a plain array outside any module, group or zeroflax.gather"
            elif index in reused:
                why = f"shared by {reused[index]} group calls within Config.max_reuse_distance: gathered once"
            else:
                why = "not used by any group, scan or zeroflax.gather"
            reasons[jax.tree_util.keystr(path)] = why
        return reasons

    def probe(self, params, batch, model_state) -> GatherUsage:
        """`probe_usage`, traced now if it has not been: the loss traced once (abstractly) with every
        ZeRO-3 leaf as a handle, to learn which leaves it gathers itself (Flax modules, groups, scans,
        zeroflax.gather) and whether Config.remat applies anywhere. Leaves it uses as plain arrays are
        then gathered on entry, as are all of them if the loss cannot run on handles at all."""
        if self.probe_usage is None:
            self.probe_usage = self._probe(params, batch, model_state)
        return self.probe_usage

    def _probe(self, params, batch, model_state) -> GatherUsage:
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
        first = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.config.grad_accum_steps,) + x.shape[1:],
                                                            x.dtype), batch)  # one micro-batch
        every_leaf = set(range(len(jax.tree.leaves(params))))

        def trace(usage, owners=frozenset()):  # a new function each time: eval_shape caches traces
            def local(params, batch, model_state):
                params, sources = self.gradient_sinks(params)
                loss, _, _ = self.traced(self.context(usage, owners), every_leaf, params, batch,
                                         jax.random.PRNGKey(0), model_state, sources)
                return loss

            fn = jax.shard_map(local, mesh=self.mesh, in_specs=(self.plan.data_specs("params"), P(DATA_AXIS), P()),
                               out_specs=P(), axis_names=set(self.manual_axes), check_vma=False)
            jax.eval_shape(fn, abstract(params), abstract(first), abstract(model_state))
            return usage

        usage = GatherUsage(probe=True)
        try:
            trace(usage)
            if usage.scan_owners:  # again, with those modules as groups: the groups the step will have
                owners = frozenset(usage.scan_owners)
                usage = trace(GatherUsage(probe=True, scan_owners=set(owners)), owners)
        except Exception as error:  # the real trace, with entry gathers, reports genuine errors
            unbound = re.search(r"unbound axis name: (\S+?)\.?(\s|$)", str(error))
            if isinstance(error, NameError) and unbound:  # not a handle's fault: it fails however gathered
                raise ConfigError("Config.data_axis_aliases", f"the model reduces over the axis name "
                                  f"{unbound.group(1)!r}, which is no mesh axis ({', '.join(self.mesh.axis_names)})",
                                  "add it to Config.data_axis_aliases if it means the data-parallel devices "
                                  "(code written for pmap, e.g. sync BatchNorm)") from error
            usage.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if self.config.zero_stage == 3 and not self.can_relocate():
                hint = (" A stack of layers run by nn.scan needs the logical name 'layers' on its stacked dimension "
                        "of every leaf above Config.persistence_threshold." if "stack of layers" in str(error) else "")
                warnings.warn(f"zeroflax: the loss cannot run on ZeRO-3 parameter handles ({usage.failed}); every "
                              f"parameter is gathered on entry instead of where it is used.{hint}", stacklevel=5)
        if self.config.remat != "none" and usage.remat_regions == 0 and not usage.failed:
            warnings.warn(
                f"Config.remat={self.config.remat!r} applies to nothing in this loss: it has no Flax module, "
                "zeroflax.group block or scanned layers to checkpoint, so all activations are kept (set "
                "Config.remat='none' to say so, or mark blocks with zeroflax.group)", stacklevel=4)
        if self.config.sequence_parallel and usage.sequence_splits == 0 and not usage.failed:
            warnings.warn(
                "Config.sequence_parallel=True applies to nothing in this loss: it marks no activation with "
                "zeroflax.sequence_split, so activations stay whole on every tensor device (mark the residual "
                "stream, as zeroflax.models.gpt does, or set sequence_parallel False)", stacklevel=4)
        if sequence_size(self.mesh) > 1 and usage.sequence_slices == 0 and not usage.failed:
            warnings.warn(
                f"the mesh splits sequences over {sequence_size(self.mesh)} devices, but this loss takes no slice with "
                "zeroflax.sequence_slice: every device of a sequence group computes the whole sequence (correct, "
                "with no activation saved). Slice the tokens, positions and targets and wrap the attention in "
                "zeroflax.sequence_attention, as zeroflax.models.gpt does", stacklevel=4)
        return usage

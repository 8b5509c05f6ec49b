"""Activation checkpointing: the named remat policies and the block boundaries the loss's own policy keeps.

Gather groups (`sharding.groups`) and scanned layers (`sharding.layers.scan_layers`) are checkpointed
blocks with `Config.remat`'s policy; their inputs and outputs are named block boundaries
(`mark_boundary`), which `loss_remat_policy`, the policy of the loss as a whole, saves (on the device,
or under 'offload_full' in pinned host memory).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


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
        # Inside a block as 'full'; what differs is where the loss keeps the blocks' inputs (below).
        "offload_full": policies.nothing_saveable,
    }[name]


# The name of the values between checkpointed blocks (a group's or a scanned layer's inputs and outputs).
BOUNDARY = "zeroflax_boundary"


def is_floating(x) -> bool:
    """Whether x is an array (or tracer) of a floating dtype: what a boundary or a tie applies to."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def mark_boundary(tree):
    """`tree` with its floating arrays named as block boundaries, which `loss_remat_policy` saves."""
    return jax.tree.map(lambda x: checkpoint_name(x, BOUNDARY) if is_floating(x) else x, tree)


def loss_remat_policy(name: str):
    """The policy for the loss as a whole (code between blocks: a model's stem, pooling, head and loss):
    it keeps the block boundaries and what the blocks' own policy keeps, and recomputes the rest in the
    backward pass. The blocks are not run again by it: their outputs and residuals are saved."""
    policy = remat_policy(name)
    if policy is None:
        return None
    if name == "offload_full":
        # DeepSpeed's cpu_checkpointing: each block's input goes to pinned host memory in the forward pass
        # and comes back for the block's recomputation; nothing else is kept.
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[BOUNDARY], offload_src="device",
            offload_dst="pinned_host")
    boundary = jax.checkpoint_policies.save_only_these_names(BOUNDARY)

    # Boundaries are saved on the device; anything else as the block policy says (an offloading
    # policy answers with an Offloadable, which save_from_both_policies would refuse).
    def keep_boundaries(prim, *args, **params):
        return True if boundary(prim, *args, **params) else policy(prim, *args, **params)
    return keep_boundaries

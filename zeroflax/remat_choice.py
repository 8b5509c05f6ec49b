"""Remat that never costs memory: for models whose checkpointed regions are recurrent, measure.

Rematerialisation keeps each group's inputs and recomputes the rest in the backward pass. On a model
whose groups run a lifted transform over shared parameters (an LSTM cell in `nn.scan` or `nn.RNN`) that
saves nothing: the scan's per-step residuals are rebuilt in the backward pass anyway, and the kept inputs
and recomputation buffers come on top (Flax's sst2 and seq2seq examples at stage 0: 1.02x and 1.03x the
temporaries of remat 'none'). There the engine compiles the step both ways once, before its first step,
and runs the one with fewer temporaries, saying so when remat saves nothing. At ZeRO stage 3 it does not:
remat is what drops the gathered weights between the forward and the backward pass, and 'none' is
refused there; nor with offload, 1-bit Adam or a pipeline, whose steps are built differently. Models
without recurrent regions are not compiled twice (their remat was measured to keep 0.66-0.77x of
'none''s temporaries: docs/zero3.md).
"""
from __future__ import annotations

import warnings


def recurrent_regions(usage) -> bool:
    """Whether the probe found a lifted transform over shared parameters (a recurrent cell), as a group
    of its own (`scan_owners`) or inside one (`lifted_in_groups`)."""
    return usage is not None and bool(usage.scan_owners or usage.lifted_in_groups)


def settle_remat(engine, state, batch) -> str:
    """The remat policy `engine` runs (its `remat` attribute, set here): Config.remat, or 'none' where
    compiling both showed that remat keeps at least as many temporaries on this model."""
    configured = engine.config.remat
    if configured == "none" or engine.config.zero_stage == 3 or not engine.parts.plain:
        return configured
    if not recurrent_regions(engine.probe(state, batch)):  # an abstract trace, no compilation
        return configured
    with_remat = engine.compile(state, batch).memory_analysis().temp_size_in_bytes
    engine.set_remat("none")
    without = engine.compile(state, batch).memory_analysis().temp_size_in_bytes
    if without <= with_remat:
        warnings.warn(f"Config.remat={configured!r} saves no memory on this model (its checkpointed regions are "
                      f"recurrent: {with_remat:,} B of temporaries with it, {without:,} B without), so the step "
                      "runs without rematerialisation", stacklevel=3)
        return "none"
    engine.set_remat(configured)
    return configured

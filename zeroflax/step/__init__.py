"""The train step's parts: where gradients come from, how they are synchronised, how the update runs,
and the loss scaler; each behind a protocol (`parts.py`), built from `Config` by `build.py` and wired
by `zeroflax.engine.Engine` (docs/design.md section 4)."""

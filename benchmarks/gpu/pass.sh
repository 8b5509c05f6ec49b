#!/usr/bin/env bash
# The GPU pass (issue 26): the whole GPU table of docs/perf.md in one command, at most 8 minutes of wall
# time on one H200.
#
# ON THE DEVICE MACHINE (from the repository root; the run tool's $OUT receives everything):
#     bash benchmarks/gpu/pass.sh                      run tool: timeout_s 540 (480 s budget + margin)
# Locally, a smoke test of every part on the CPU (tiny shapes; 40-90 s on 2 shared cores):
#     SMOKE=1 bash benchmarks/gpu/pass.sh              PYTHON=... to pick the interpreter
#
# PARTS, in this order, each in its own Python process (benchmarks/gpu/pass_parts.py PART):
#   (a) probe             probe.py: python/jax/jaxlib/flax/optax versions, device kind/count/memory, commit
#                         (read from .git without a git binary, else env COMMIT, else "unknown"), and the
#                         two ceilings every later figure is divided by: a bf16 8192^3 matmul's TFLOP/s
#                         and a 2 GiB device-to-device copy's GB/s (bytes read + written).
#   (b) onebit            onebit_kernels.py: 1-bit Adam's Pallas kernels (pack_signs, unpack_signs
#                         average=False/True) on 8 x 12.5M float32: bitwise equal to impl='xla', GB/s of
#                         the bytes they must move, as a fraction of (a)'s copy GB/s; the jnp version's too.
#   (c) host_bandwidth    host_bandwidth.py: pinned_host / unpinned_host / numpy <-> device, each
#                         direction and both at once, 256 MiB and 1 GiB, GB/s.
#   (d) sparse_attention  sparse_attention.py's functions: window (~10% density, shapes.SPARSE_WINDOWS)
#                         and BigBird at 8k/16k/32k, head_dim 64/128, forward and forward+backward vs
#                         cuDNN's dense attention (a row says so if cuDNN is unavailable), after the
#                         script's correctness check; time, TFLOP/s of computed blocks, speedup.
#   (e) train_mfu         train_mfu.py's main: GPT 1.3B, then 350M, then 125M while time allows,
#                         --attention cudnn; MFU against 989 (datasheet) and (a)'s measured matmul.
#   (f) offload           offload.py's main, ratio phase: 1.3B step time with offload, + DPU, + DPU
#                         'linear', each / no offload (configs that would overrun are skipped).
# The shapes are in benchmarks/gpu/shapes.py (shared with the CUDA-lowering test).
#
# BUDGET RULES (pass_runner.py). Global budget PASS_BUDGET_S (default 480 s) from the runner's start.
#   * Part p's timeout = min(cap_p, budget left - 3 s reserve); a part whose timeout would be under 3 s
#     is not started ('skipped', with a row saying so). Caps (s): a 45, b 60, c 45, d 130, e 130, f 240
#     (PASS_CAPS="d=150,e=100" overrides). The last part, f, in effect gets whatever is left.
#   * Each part also gets a deadline (epoch seconds, a little before its timeout): parts with several
#     units of work (shapes in b and d, sizes in e, configurations in f) start the next unit only if the
#     last unit's wall time still fits, and record the skipped ones as rows saying so.
#   * On timeout the part's process group gets SIGTERM, then SIGKILL 3 s later; status 'timeout'.
#     A non-zero exit is 'failed' (the error is the last exception line of its stderr; parts that run
#     but fail their own check, e.g. bits that differ, exit 1 with 'PartFailure: ...'). Either way the
#     pass goes on with the next part: a failure never removes what other parts measured, and a part's
#     rows written before it died (parts write their JSON after every row) are kept.
#   * The runner (standard library only, never jax) rewrites results.json and summary.md BEFORE the first
#     part and AFTER EVERY part (also after a skip, and on SIGTERM/SIGINT, marking the running part
#     'interrupted'), so a pass cut short at any point keeps everything measured until then.
#   Expected H200 times (from the shapes, ~790 TFLOP/s bf16 and ~4.3 TB/s; each includes ~8 s of process
#   and CUDA start-up): a ~15 s (a 1.1 TFLOP matmul takes 1.4 ms, a 4.3 GB copy 1 ms: samples of ~30 ms);
#   b ~40 s (12 jits of 8 kernel calls; pack moves 1.21 GB in ~0.3 ms: compiles dominate); c ~20 s (1 GiB
#   over PCIe 5 at ~50 GB/s pinned is ~20 ms, pageable a few times that; numpy fills the sources);
#   d ~115 s (36 compiles of Pallas/cuDNN fwd and fwd+bwd at ~2-3 s; dense 32k x d128 is 8.8 TFLOP
#   forward, ~20 ms, the 10% window ~0.9 TFLOP); e ~125 s (1.3B: ~50 s compile, 70 TFLOP per step of
#   8 x 1024 tokens, ~0.15 s at 50% MFU; 350M ~35 s; 125M only if the last size's time still fits);
#   f ~150 s (per config ~60 s of init + compile, offloaded steps ~2-4 s: the host AdamW streams ~39 GB
#   of host memory per step; no offload and offload fit, the DPU variants when time is left).
#   Sum ~465 s: inside 480, and the rules above keep the wall time under the budget whatever happens.
#
# OUTPUT (at most 8 files, the device run tool's limit): $OUT if set, else $PASS_OUT, else ./gpu_pass_out:
#     summary.md                 markdown tables, docs/perf.md's style, ready to paste (status table first)
#     results.json               every part: status, rc, time, timeout, error, stderr tail, and its JSON
#     logs/<letter>_<name>.log   each part's full stdout and stderr (last 4 MiB of each), six files
# Per-part JSON files would make 14; results.json carries them instead (rewritten after every part).
#
# ENVIRONMENT: PYTHON (default python3), PASS_BUDGET_S, PASS_PARTS=a,b (a subset, by letter or name),
# PASS_CAPS, SMOKE=1 (CPU: JAX_PLATFORMS=cpu, one device, XLA's cheapest compiles, Pallas interpret mode,
# shapes.SMOKE_* / --quick sizes, XLA's dense attention for cuDNN's), COMMIT (when there is no .git).
# Test hooks: PASS_FAIL=c makes part c raise at its start; PASS_HANG=a makes part a hang until killed.
# Exit status: 0 when every selected part is 'ok', 1 when any is not, 2 when the pass was interrupted.
# The pass imports neither gin-config nor tensorboardX (each part's JSON lists any that got imported;
# tests/test_gpu_pass.py runs it with both blocked) and needs no git binary and no zeroflax install:
# its scripts put the repository root on sys.path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "pass.sh: no Python interpreter '$PYTHON' (set PYTHON)" >&2
    exit 2
fi

if [[ "${SMOKE:-0}" != "0" && -n "${SMOKE:-}" ]]; then
    export SMOKE=1
    export JAX_PLATFORMS=cpu
    # One CPU device (drop an inherited simulated device count, e.g. pytest's 8) and XLA's cheapest
    # compiles: the smoke run compiles dozens of small programs.
    flags=""
    for flag in ${XLA_FLAGS:-}; do
        [[ "$flag" == --xla_force_host_platform_device_count=* ]] || flags="$flags $flag"
    done
    export XLA_FLAGS="${flags# } --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    export XLA_FLAGS="${XLA_FLAGS# }"
fi

exec "$PYTHON" "$HERE/pass_runner.py"

"""NVMe offload (OffloadOptimizerConfig.device = 'nvme'): host memory bounded by the buffers, disk bytes against
the theory, and a GPT whose model states are twice the memory the process may use.

Two commands, each on 8 simulated CPU devices, ZeRO-3, bf16 compute (fp32 master weights, AdamW):

    python benchmarks/nvme_offload.py rss --path /tmp/zf_nvme [--json out.json]
        Two GPT sizes (about 25M and 100M parameters), three steps each. Per step: the bytes the state's file
        read and wrote beside the theory (12 bytes per parameter each way), and the host memory the streamed
        update took: its peak RSS above the RSS it started at (the kernel's high-water mark, VmHWM, reset
        through /proc/self/clear_refs before it) against the stream's buffers. On the CPU backend the
        devices' memory is host memory too, so only the update's own growth is the host's.

    python benchmarks/nvme_offload.py limit --path /tmp/zf_nvme [--margin_gib 0.5] [--json out.json]
        A GPT of about 510M parameters (d_model 1536, 18 layers): its master weights and Adam state take 12
        bytes per parameter, 5.7 GiB. Four runs of three steps in child processes: NVMe offload and host offload
        ('cpu') without a limit (each one's peak RSS: what it needs), then both under a cgroup memory limit of
        NVMe's need plus `--margin_gib` (or `--limit_gib`): NVMe trains, host offload is killed. The losses of
        the limited NVMe run and the unlimited host-offload run must agree. On the CPU backend the 8 simulated
        devices' memory (the compute copy, the gradients, the step's temporaries) is the process's memory too,
        so the limit must hold what a GPU would: the margin is the host memory left for model states, against
        the 5.7 GiB the file holds. Also the disk's bandwidth, measured through the same file layer (a 2 GiB file
        written and read in 64 MiB records with O_DIRECT), and time per step. Needs root (a cgroup v1 memory
        controller under /sys/fs/cgroup/memory).

Recorded in docs/perf.md ("NVMe offload").
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax import Config, OffloadOptimizerConfig  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402
from zeroflax.step.streamed_update import StreamedUpdate  # noqa: E402

SEQ = 32


def status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def build(d_model: int, layers: int, offload: OffloadOptimizerConfig, seed: int = 0):
    model = GPT(GPTConfig(vocab_size=256, num_layers=layers, d_model=d_model, num_heads=max(1, d_model // 128),
                          max_len=SEQ))
    config = Config(zero_stage=3, precision="bf16", micro_batch_size=1, persistence_threshold=0, remat="full",
                    grad_clip=1.0, offload_optimizer=offload, seed=seed)
    sample = {"tokens": np.zeros((1, SEQ + 1), np.int32)}
    return zeroflax.initialize(next_token_loss(model), lambda k, b: model.init(k, b["tokens"][:, :-1])["params"],
                               optax.adamw(1e-4, weight_decay=0.1), config, sample_batch=sample)


def batches(steps: int):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 256, size=(jax.device_count(), SEQ + 1)).astype(np.int32)} for _ in range(steps)]


# --------------------------------------------------------------------------------------- rss
def measure_rss(path: str, d_model: int, layers: int, steps: int, buffer_size: int) -> dict:
    shutil.rmtree(path, ignore_errors=True)
    offload = OffloadOptimizerConfig("nvme", nvme_path=path, buffer_size=buffer_size)
    engine, state = build(d_model, layers, offload)
    update: StreamedUpdate = engine.update
    num_params = sum(x.size for x in jax.tree.leaves(engine.abstract_params))
    finish = StreamedUpdate.finish
    rows = []

    def measured_finish(self, state, metrics):
        jax.block_until_ready((state.pending_grads, metrics))
        reset_peak()
        before = status("VmRSS")
        started = time.perf_counter()
        new = finish(self, state, metrics)
        jax.block_until_ready(new.compute_params)
        read, written = self.disk_traffic()
        rows.append(dict(update_s=time.perf_counter() - started, rss_before=before, update_growth=status("VmHWM") - before,
                         read=read, written=written))
        return new

    StreamedUpdate.finish = measured_finish
    try:
        for batch in batches(steps):
            started = time.perf_counter()
            state, metrics = engine.step(state, batch)
            float(metrics["loss"])
            rows[-1]["step_s"] = time.perf_counter() - started
            rows[-1]["loss"] = float(metrics["loss"])
    finally:
        StreamedUpdate.finish = finish
    theory = update.disk_traffic_theory()[0]
    out = dict(d_model=d_model, layers=layers, num_params=num_params, chunks=len(update.layout.chunks),
               buffers=update.host_buffer_bytes(), theory_each_way=theory, steps=rows,
               disk_ratio=max(max(r["read"], r["written"]) / theory for r in rows),
               update_growth_max=max(r["update_growth"] for r in rows))
    print(f"  GPT d{d_model} x{layers}: {num_params / 1e6:.1f}M parameters, {out['chunks']} chunks; buffers "
          f"{out['buffers'] / 2**20:.0f} MiB")
    for i, r in enumerate(rows):
        print(f"    step {i + 1}: loss {r['loss']:.4f}, {r['step_s']:.1f} s (update {r['update_s']:.1f} s); disk read "
              f"{r['read'] / 2**20:.1f} MiB, written {r['written'] / 2**20:.1f} MiB, theory {theory / 2**20:.1f} MiB "
              f"({r['read'] / theory:.4f}x); update's RSS growth {r['update_growth'] / 2**20:.0f} MiB")
    update.store.close()
    shutil.rmtree(path, ignore_errors=True)
    return out


def cmd_rss(args) -> dict:
    print(f"host memory of the NVMe update (buffer_size {args.buffer_size:,} elements, 4 buffers)")
    return {"sizes": [measure_rss(args.path, d, layers, args.steps, args.buffer_size)
                      for d, layers in ((512, 8), (1024, 8))]}


# ------------------------------------------------------------------------------------- limit
def run_child(path: str, device: str, steps: int) -> dict:
    """Inside the child: the big GPT for `steps` steps; prints one JSON line per step."""
    offload = (OffloadOptimizerConfig("nvme", nvme_path=path, buffer_size=10_000_000) if device == "nvme"
               else OffloadOptimizerConfig("cpu"))
    started = time.perf_counter()
    engine, state = build(1536, 18, offload)
    print(json.dumps({"init_s": time.perf_counter() - started, "rss": status("VmRSS"),
                      "num_params": sum(x.size for x in jax.tree.leaves(engine.abstract_params))}), flush=True)
    for batch in batches(steps):
        started = time.perf_counter()
        state, metrics = engine.step(state, batch)
        loss = float(metrics["loss"])
        row = {"loss": loss, "step_s": time.perf_counter() - started, "rss": status("VmRSS"), "peak": status("VmHWM")}
        if device == "nvme":
            row["read"], row["written"] = engine.update.disk_traffic()
            row["theory"] = engine.update.disk_traffic_theory()[0]
        print(json.dumps(row), flush=True)
    return {}


def in_cgroup(limit: int | None, argv: list) -> tuple[int, list, str]:
    """Run `argv` (a child of this script) in a fresh memory cgroup of `limit` bytes (None: no limit)."""
    group = None
    if limit is not None:
        own = next(line.split(":", 2)[2].strip() for line in open("/proc/self/cgroup") if ":memory:" in line)
        group = os.path.join("/sys/fs/cgroup/memory", own.lstrip("/"), f"zeroflax_nvme_{os.getpid()}")
        os.makedirs(group, exist_ok=True)
        for name in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"):
            try:
                with open(os.path.join(group, name), "w") as f:
                    f.write(str(limit))
            except OSError:
                pass  # no swap accounting
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__)] + argv, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             preexec_fn=(lambda: open(os.path.join(group, "cgroup.procs"), "w").write(str(os.getpid())))
                             if group else None)
    lines = []
    for line in child.stdout:
        lines.append(line.rstrip())
        if line.startswith("{"):
            print("    " + line.rstrip(), flush=True)
    code = child.wait()
    peak_note = ""
    if group:
        try:
            with open(os.path.join(group, "memory.max_usage_in_bytes")) as f:
                peak_note = f"cgroup peak {int(f.read()) / 2**30:.2f} GiB"
        except OSError:
            pass
        os.rmdir(group)
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    return code, rows, peak_note


def disk_bandwidth(path: str, gib: int = 2) -> dict:
    """Sequential write and read of a `gib` GiB file in 64 MiB records through zeroflax.disk.files (O_DIRECT)."""
    from zeroflax.disk.files import BufferPool, RecordFile
    record = 64 << 20
    count = gib * 1024 // 64
    name = os.path.join(path, "bandwidth.bin")
    os.makedirs(path, exist_ok=True)
    file = RecordFile(name, [record] * count, key="bandwidth", create=True)
    pool = BufferPool(1, record)
    buf = pool.acquire()
    started = time.perf_counter()
    for i in range(count):
        file.write(i, buf)
    file.flush()
    write = count * record / (time.perf_counter() - started)
    started = time.perf_counter()
    for i in range(count):
        file.read(i, buf)
    read = count * record / (time.perf_counter() - started)
    pool.release(buf)
    pool.close()
    file.close()
    os.remove(name)
    return dict(write=write, read=read, direct=file.direct)


def cmd_limit(args) -> dict:
    bandwidth = disk_bandwidth(args.path)
    print(f"disk: write {bandwidth['write'] / 1e9:.2f} GB/s, read {bandwidth['read'] / 1e9:.2f} GB/s "
          f"(O_DIRECT {bandwidth['direct']}, 64 MiB records)")
    out = {"bandwidth": bandwidth, "runs": {}}

    def run(name, device, limit):
        shutil.rmtree(args.path, ignore_errors=True)
        print(f"  {name}" + (f" (limit {limit / 2**30:.2f} GiB)" if limit else ""))
        code, rows, note = in_cgroup(limit, ["child", "--path", args.path, "--device", device, "--steps", str(args.steps)])
        peak = max((r.get("peak", r.get("rss", 0)) for r in rows), default=0)
        print(f"    exit code {code}; peak RSS {peak / 2**30:.2f} GiB{'; ' + note if note else ''}")
        out["runs"][name] = dict(exit_code=code, rows=rows, cgroup=note, peak=peak, limit=limit)
        return peak

    # Unlimited first: what each needs. On the CPU backend the 8 simulated devices' memory (the compute copy,
    # the gradients, the step's temporaries) is the process's memory too, so the limit is NVMe's need plus a
    # margin: what is left for model states on the host side, against the 12 bytes per parameter on disk.
    nvme_peak = run("nvme, unlimited", "nvme", None)
    host_peak = run("cpu, unlimited", "cpu", None)
    limit = args.limit_gib * 2**30 if args.limit_gib else int(-(-(nvme_peak + args.margin_gib * 2**30) // 2**28) * 2**28)
    run("nvme, limited", "nvme", limit)
    run("cpu, limited", "cpu", limit)
    shutil.rmtree(args.path, ignore_errors=True)
    losses = lambda name: [r["loss"] for r in out["runs"][name]["rows"] if "loss" in r]
    num_params = next(r["num_params"] for r in out["runs"]["nvme, unlimited"]["rows"] if "num_params" in r)
    out.update(limit=limit, num_params=num_params, nvme_peak=nvme_peak, host_peak=host_peak,
               disk_states=12 * num_params, host_side=limit - nvme_peak)
    print(f"  limit {limit / 2**30:.2f} GiB = NVMe's need {nvme_peak / 2**30:.2f} GiB + {(limit - nvme_peak) / 2**30:.2f} GiB; "
          f"master weights and Adam state {12 * num_params / 2**30:.2f} GiB (on disk with NVMe; host offload needs "
          f"{host_peak / 2**30:.2f} GiB in all)")
    for name in ("nvme, limited", "cpu, unlimited"):
        print(f"  losses {name}: {losses(name)}")
    if losses("nvme, limited") and losses("cpu, unlimited"):
        out["max_loss_difference"] = max(abs(a - b) for a, b in zip(losses("nvme, limited"), losses("cpu, unlimited")))
        print(f"  largest loss difference: {out['max_loss_difference']:.3g}")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rss = sub.add_parser("rss")
    rss.add_argument("--path", required=True)
    rss.add_argument("--steps", type=int, default=3)
    rss.add_argument("--buffer_size", type=int, default=2_000_000)
    rss.add_argument("--json")
    limit = sub.add_parser("limit")
    limit.add_argument("--path", required=True)
    limit.add_argument("--limit_gib", type=float, default=0.0, help="0: NVMe's unlimited peak + --margin_gib")
    limit.add_argument("--margin_gib", type=float, default=0.5)
    limit.add_argument("--steps", type=int, default=3)
    limit.add_argument("--json")
    child = sub.add_parser("child")
    child.add_argument("--path", required=True)
    child.add_argument("--device", required=True)
    child.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.command == "child":
        run_child(args.path, args.device, args.steps)
        return
    result = cmd_rss(args) if args.command == "rss" else cmd_limit(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""summary.md of the GPU pass: markdown tables (docs/perf.md's style, ready to paste) from results.json.

pass_runner.py calls ``render(results)`` after every part; standalone:
``python benchmarks/gpu/pass_summary.py gpu_pass_out/results.json > summary.md``.
Only the standard library: the runner never imports jax.
"""
from __future__ import annotations

import json
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import passlib  # noqa: E402


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def f(x, spec=".1f", suffix="") -> str:
    return f"{x:{spec}}{suffix}" if _num(x) else ""


def g(x, suffix="") -> str:
    """A rate or size: whole numbers from 100, one decimal from 1, three significant digits below."""
    if not _num(x):
        return ""
    return (f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 1 else f"{x:.3g}") + suffix


def pct(x) -> str:
    return f"{100 * x:.1f}%" if _num(x) else ""


def ms(x) -> str:
    return f"{x * 1e3:.3f}" if _num(x) and x < 0.1 else (f"{x * 1e3:.1f}" if _num(x) else "")


def cell(text, width=120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= width else text[:width - 3] + "..."


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def ceilings(results) -> dict:
    probe = ((results.get("parts") or {}).get("a") or {}).get("result") or {}
    return {k: v for k, v in (probe.get("ceilings") or {}).items() if _num(v)}


# --------------------------------------------------------------------------------------------- parts
def section_a(data, results) -> list[str]:
    meta, c = data.get("meta") or {}, data.get("ceilings") or {}
    rows = []
    for r in data.get("rows", []):
        if "tflops" in r:
            rows.append([r["name"], g(r["tflops"]) + " TFLOP/s", ms(r["median_s"]),
                         f"{pct(r['tflops'] / passlib.DATASHEET_BF16_TFLOPS)} of the datasheet's "
                         f"{passlib.DATASHEET_BF16_TFLOPS:g}; {r.get('calls_per_sample')} calls per sample"])
        elif "gbs" in r:
            rows.append([f"{r['name']}, {r['bytes'] / 2**30:.3g} GiB", g(r["gbs"]) + " GB/s", ms(r["median_s"]),
                         "bytes read + written" + (" (the ceiling)" if _num(c.get("copy_gbs")) and
                                                   abs(r["gbs"] - c["copy_gbs"]) < 1e-9 else "")])
    out = table(["ceiling", "measured", "median (ms)", "note"], rows)
    v = meta.get("versions") or {}
    mem = meta.get("device_memory_limit")
    host = (meta.get("host_memory") or {}).get("MemTotal")
    out += ["", f"- Device: {meta.get('device_kind')} x {meta.get('device_count')} ({meta.get('platform')}), "
                f"memory limit {f(mem / 2**30, '.1f') + ' GiB' if _num(mem) else 'n/a'}; host "
                f"{f(host / 2**30, '.0f') + ' GiB' if _num(host) else 'n/a'}, "
                f"{(meta.get('host_memory') or {}).get('cpus')} CPUs.",
            "- Versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".",
            f"- Commit: {meta.get('commit')} ({meta.get('commit_source')})."]
    if c.get("note"):
        out.append(f"- Note: {c['note']}.")
    return out


def section_b(data, results) -> list[str]:
    meta = data.get("meta") or {}
    checks = {c.get("cols"): c for c in data.get("checks", [])}
    rows = []
    for r in data.get("rows", []):
        shape = f"{r.get('rows')} x {r.get('cols'):,}" if _num(r.get("cols")) else ""
        if "gbs" not in r:
            rows.append([shape, r.get("kernel", ""), r.get("impl", ""), "", "", "", "", "",
                         cell(r.get("error", "not measured"), 80)])
            continue
        equal = (checks.get(r["cols"]) or {}).get("bitwise_equal", {}).get(r["kernel"])
        rows.append([shape + (" (padded)" if r.get("padded") else ""), r["kernel"], r["impl"],
                     g(r["bytes"] / 1e6), ms(r["median_s"]), g(r["gbs"]), pct(r.get("of_copy_ceiling")),
                     "" if equal is None else ("yes" if equal else "**NO**"), ""])
    out = table(["R x C", "kernel", "impl", "min. bytes (MB)", "median (ms)", "GB/s", "of copy ceiling",
                 "Pallas bitwise = jnp", "note"], rows)
    cc = (meta.get("ceilings") or {}).get("copy_gbs")
    formulas = "; ".join(f"{k}: {v}" for k, v in (meta.get("bytes_formula") or {}).items())
    out += ["", f"- Bytes: each kernel's minimum ({formulas}), "
                f"N = R x C; copy ceiling {g(cc) + ' GB/s (part a)' if _num(cc) else 'n/a (no probe)'}; "
                f"{meta.get('calls_per_jit')} calls per timed jit, each on its own inputs."]
    if any(r.get("padded") for r in data.get("rows", [])):
        out.append("- Padded: C is not a multiple of 2048, so the Pallas path pads its inputs and slices its "
                   "outputs (timed, not counted as bytes).")
    for c in data.get("checks", []):
        if c.get("error"):
            out.append(f"- Bitwise check at {c.get('rows')} x {c.get('cols'):,}: raised `{cell(c['error'], 200)}`")
            continue
        out.append(f"- Bitwise check at {c.get('rows')} x {c.get('cols'):,}: "
                   + ", ".join(f"{k} {'equal' if v else 'DIFFERENT'}"
                               for k, v in (c.get("bitwise_equal") or {}).items()))
    return out


def section_c(data, results) -> list[str]:
    rows = []
    for r in data.get("rows", []):
        if "gbs" in r:
            rows.append([r.get("memory"), f(r.get("mib"), ".0f"), r.get("direction"), r.get("how", ""),
                         ms(r["median_s"]), g(r["gbs"]), ""])
        else:
            rows.append([r.get("memory"), f(r.get("mib"), ".0f"), r.get("direction"), r.get("how", ""), "", "",
                         cell(r.get("error", ""), 100)])
    out = table(["host memory", "MiB", "direction", "how", "median (ms)", "GB/s", "note"], rows)
    out += ["", "- GB/s = bytes moved / time (both at once: the two transfers' bytes together). 'in jit': the "
                "transfers inside one jitted program, as the offloaded step does them."]
    return out


def section_d(data, results) -> list[str]:
    meta = data.get("meta") or {}
    out = []
    check = meta.get("check")
    if check and check.get("error"):
        out += [f"Correctness first: the check raised `{cell(check['error'], 200)}`: **FAILED**.", ""]
    elif check:
        errs = check.get("rel_err_out_dq_dk_dv") or {}
        worst = {k: max(v) if all(_num(x) for x in v) else float("nan") for k, v in errs.items()}
        out += [f"Correctness first ({check.get('what')}): max relative error "
                + ", ".join(f"{k} {v:.2e} (tolerance {check.get('tolerance', {}).get(k)})" for k, v in worst.items())
                + f": **{'passed' if check.get('passed') else 'FAILED'}**.", ""]
    dense = meta.get("dense_impl")
    label = {"cudnn": "cuDNN", "xla": "XLA (smoke)"}.get(dense, "cuDNN")
    rows = []
    for r in data.get("rows", []):
        if "fwd_s" not in r:
            rows.append([r.get("head_dim"), r.get("L"), r.get("kind"), f(r.get("density"), ".3f"),
                         *[""] * 6, cell(r.get("error", ""), 100)])
            continue
        is_dense = r["kind"].startswith("dense")
        rows.append([r["head_dim"], r["L"], r["kind"], f(r["density"], ".3f"), ms(r["fwd_s"]), g(r["fwd_tflops"]),
                     "1.00x" if is_dense else f(r.get("fwd_speedup_vs_dense"), ".2f", "x"),
                     ms(r["fwdbwd_s"]), g(r["fwdbwd_tflops"]),
                     "1.00x" if is_dense else f(r.get("fwdbwd_speedup_vs_dense"), ".2f", "x"), ""])
    out += table(["head_dim", "L", "layout", "density", "fwd (ms)", "fwd TFLOP/s", f"fwd speedup vs {label}",
                  "fwd+bwd (ms)", "fwd+bwd TFLOP/s", f"fwd+bwd speedup vs {label}", "note"], rows)
    out += ["", f"- bf16, batch {meta.get('batch')}, {meta.get('heads')} heads, block {meta.get('block')}, "
                f"non-causal; windows (blocks) per L: {meta.get('windows')}. TFLOP/s of the computed blocks: "
                f"{meta.get('flops')}.",
            f"- Dense baseline: jax.nn.dot_product_attention(implementation={dense!r})"
            + (f" ({meta.get('dense_note')})" if meta.get("dense_note") else "") + "."]
    return out


def section_e(data, results) -> list[str]:
    c = ceilings(results)
    measured = c.get("matmul_tflops")
    rows = []
    for r in data.get("rows", []):
        if "median_step_s" not in r:
            rows.append([r.get("size"), "", r.get("batch", ""), r.get("attention", ""), "", "", "", "", "",
                         cell(r.get("error", "") + ("; " + r["notes"] if r.get("notes") else ""), 120)])
            continue
        mm = r.get("mfu_measured_ceiling", r["tflops"] / measured if _num(measured) else None)
        rows.append([r["size"], f"{r['params'] / 1e6:.1f}M", f"{r['batch']} x {r['seq']}", r["attention"],
                     f(r["median_step_s"] * 1e3), f(r["tokens_per_s"], ",.0f"), g(r["tflops"]),
                     pct(r["tflops"] / passlib.DATASHEET_BF16_TFLOPS), pct(mm), cell(r.get("notes", ""), 120)])
    head = f"MFU (measured {g(measured)})" if _num(measured) else "MFU (measured ceiling)"
    out = table(["model", "params", "batch x seq", "attention", "median step (ms)", "tokens/s", "TFLOP/s",
                 f"MFU ({passlib.DATASHEET_BF16_TFLOPS:g} datasheet)", head, "notes"], rows)
    meta = data.get("meta") or {}
    out += ["", f"- Model FLOPs per token: {meta.get('flops_formula')}. bf16 compute, fp32 master weights and "
                f"AdamW, remat none, ZeRO stage 0, one device.",
            f"- MFU against the datasheet's {passlib.DATASHEET_BF16_TFLOPS:g} TFLOP/s and against the probe's "
            f"measured bf16 matmul ({g(measured) + ' TFLOP/s' if _num(measured) else 'n/a'})."]
    return out


def section_f(data, results) -> list[str]:
    rows = []
    big = max([r.get(k) or 0 for r in data.get("rows", []) for k in ("device_at_rest", "host_at_rest")] + [0])
    unit, scale = ("GiB", 2**30) if big >= 2**30 else ("MiB", 2**20)
    for r in data.get("rows", []):
        if r.get("phase") != "ratio":
            continue
        if "median_step_s" not in r:
            rows.append([r.get("mode"), "", "", "", "", "", "", "", cell(r.get("error", ""), 120)])
            continue
        gib = lambda x: f(x / scale, ".2f") if _num(x) else ""  # noqa: E731
        rows.append([r["mode"], f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.3f}M",
                     f"{r['batch']} x {r['seq']}", f(r["median_step_s"] * 1e3),
                     f(r.get("ratio_to_no_offload"), ".2f", "x") if r["mode"] != "no offload" else "1.00x",
                     gib(r.get("device_at_rest")), gib((r.get("host_at_rest") or 0) + (r.get("pending_grads") or 0)),
                     f"{f(r.get('loss_first'), '.3f')} -> {f(r.get('loss_last'), '.3f')}",
                     f"{r.get('steps_timed')} steps timed, compile {f(r.get('compile_s'), '.0f')} s"])
    out = table(["config", "params", "batch x seq", "median step (ms)", "vs no offload", f"device at rest ({unit})",
                 f"host at rest ({unit})", "loss first -> last", "note"], rows)
    meta = data.get("meta") or {}
    model = meta.get("model") or {}
    out += ["", f"- GPT d {model.get('d_model')}, seq {model.get('seq')}, ZeRO stage {model.get('zero_stage')}, "
                f"remat {model.get('remat')}, bf16; offload: master weights and Adam in pinned host memory, the "
                "update on the host; DPU: the delayed parameter update from the first step."]
    return out


# ---------------------------------------------------------------------------------------------- goals
def _part_rows(results, letter) -> list[dict]:
    return ((((results.get("parts") or {}).get(letter) or {}).get("result") or {}).get("rows")) or []


def goals(results) -> list[str]:
    """Issue 26's three GPU goals, each met, missed or not measured, from the parts' rows."""
    rows = []
    mm = ceilings(results).get("matmul_tflops")
    mfu = [(r["tflops"] / mm, r["size"]) for r in _part_rows(results, "e") if _num(r.get("tflops")) and _num(mm)]
    rows.append(["GPT MFU >= 55% of the measured matmul ceiling",
                 ", ".join(f"{s}: {pct(x)}" for x, s in mfu) or "not measured",
                 ("met" if max(mfu)[0] >= 0.55 else "missed") if mfu else "-"])
    sparse = [(r[key], f"{r['kind']} L {r['L']} d {r['head_dim']} {what}")
              for r in _part_rows(results, "d") if not str(r.get("kind", "")).startswith("dense")
              and str(r.get("kind", "")).startswith("window")
              for key, what in (("fwd_speedup_vs_dense", "fwd"), ("fwdbwd_speedup_vs_dense", "fwd+bwd"))
              if _num(r.get(key))]
    rows.append(["sparse attention at ~10% density >= 5x cuDNN's dense",
                 (f"{min(sparse)[0]:.2f}x ({min(sparse)[1]}) to {max(sparse)[0]:.2f}x ({max(sparse)[1]})"
                  if sparse else "not measured"),
                 ("met at every shape" if min(sparse)[0] >= 5 else
                  f"met at {sum(x >= 5 for x, _ in sparse)} of {len(sparse)}") if sparse else "-"])
    onebit = [(r["of_copy_ceiling"], f"{r['kernel']} {r['rows']} x {r['cols']:,}")
              for r in _part_rows(results, "b") if r.get("impl", "").startswith("pallas")
              and _num(r.get("of_copy_ceiling"))]
    rows.append(["1-bit kernels >= 70% of the copy bandwidth",
                 (f"{pct(min(onebit)[0])} ({min(onebit)[1]}) to {pct(max(onebit)[0])} ({max(onebit)[1]})"
                  if onebit else "not measured"),
                 ("met by every kernel" if min(onebit)[0] >= 0.7 else
                  f"met by {sum(x >= 0.7 for x, _ in onebit)} of {len(onebit)}") if onebit else "-"])
    return table(["goal (issue 26)", "measured", "verdict"], rows)


SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e, "f": section_f}


# ---------------------------------------------------------------------------------------------- all
def render(results: dict) -> str:
    meta = results.get("meta") or {}
    parts = results.get("parts") or {}
    probe = ((parts.get("a") or {}).get("result") or {}).get("meta") or {}
    device = f"{probe.get('device_kind')} x {probe.get('device_count')}" if probe else "device not probed"
    lines = [f"# GPU pass: {device}, {meta.get('date', '')}", ""]
    if meta.get("smoke"):
        lines += ["**SMOKE=1: tiny shapes on the CPU (Pallas interpret mode); the numbers mean nothing.**", ""]
    lines += [f"- Commit {meta.get('commit')} ({meta.get('commit_source')}); python {meta.get('python_version')}, "
              f"jax {probe.get('versions', {}).get('jax', '?') if probe else '?'}.",
              f"- Command: `{meta.get('command')}`; budget {meta.get('budget_s')} s, "
              f"{f(meta.get('elapsed_s'), '.0f')} s spent" + (" (finished)" if meta.get("finished") else
                                                  " (interrupted)" if meta.get("interrupted") else " (running)") + ".",
              ""]
    rows = []
    for letter in meta.get("parts_selected", list(passlib.PARTS)):
        entry = parts.get(letter) or {}
        name, title = passlib.PARTS[letter]
        status = entry.get("status", "pending")
        note = entry.get("error") or entry.get("note") or ""
        rows.append([f"({letter})", name, f"**{status}**" if status not in ("ok", "pending") else status,
                     f(entry.get("elapsed_s")), f(entry.get("timeout_s"), ".0f"), cell(note, 140)])
    lines += table(["part", "name", "status", "time (s)", "timeout (s)", "note"], rows)
    lines += ["", "## Goals", ""] + goals(results)
    for letter in meta.get("parts_selected", list(passlib.PARTS)):
        entry = parts.get(letter)
        if not entry:
            continue
        name, title = passlib.PARTS[letter]
        lines += ["", f"## ({letter}) {title}", ""]
        status = entry.get("status")
        if status != "ok":
            after = f" after {entry['elapsed_s']:.1f} s" if _num(entry.get("elapsed_s")) else ""
            lines.append(f"**{status}**" + after
                         + (f" (rc {entry['rc']})" if entry.get("rc") is not None else "")
                         + (f": `{cell(entry['error'], 300)}`" if entry.get("error") else "")
                         + (f"; log: `{entry['log']}`" if entry.get("log") else "") + ".")
            tail = (entry.get("stderr_tail") or "").strip().splitlines()[-12:]
            if tail:
                lines += ["", "Last lines of its stderr:", "", "```", *tail, "```"]
            lines.append("")
        data = entry.get("result")
        if data:
            if status != "ok":
                lines += ["What it measured before that:", ""]
            try:
                lines += SECTIONS[letter](data, results)
            except Exception as e:  # noqa: BLE001 - a summary must always be written
                lines.append(f"(could not render this part's table: {type(e).__name__}: {e})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0] if argv else "gpu_pass_out/results.json") as fh:
        sys.stdout.write(render(json.load(fh)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

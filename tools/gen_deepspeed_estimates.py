"""Generate the expected DeepSpeed memory estimates from DeepSpeed's own estimator functions.

Usage (the repository's venv is enough: no torch, no DeepSpeed install)::

    .venv/bin/python tools/gen_deepspeed_estimates.py /work/.mirror/deepspeedai+DeepSpeed/repo \
        --commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641 --out tests/data/deepspeed_estimates.json

The first argument is a DeepSpeed git directory (bare or not). The two estimator functions,
``estimate_zero2_model_states_mem_needs`` (deepspeed/runtime/zero/stage_1_and_2.py) and
``estimate_zero3_model_states_mem_needs`` (deepspeed/runtime/zero/stage3.py), are read with
``git show <commit>:<path>``; ``ast`` takes just those two function definitions out of the files (the
modules themselves import torch) and they are executed on their own. Nothing of DeepSpeed's source is
written out: the JSON holds the arguments of every case and the tuple DeepSpeed's function returned,
plus the commit it came from. ``tests/test_estimate.py`` checks ``zeroflax.estimate``'s own
implementation against every case.

The grid: GPT-like models of about 125M, 1.3B and 13B parameters with their largest layer (the token
embedding, the largest single module of a GPT), plus zeroflax's main-job GPT; GPUs per node 1, 4, 8,
16; nodes 1, 2, 4; every combination of cpu_offload, cpu_offload_params and zero_init (stage 3; also
cpu_offload_params without cpu_offload, which DeepSpeed's own table skips); buffer factors 1.0 and 1.5.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import subprocess

FILES = {
    "zero2": ("deepspeed/runtime/zero/stage_1_and_2.py", "estimate_zero2_model_states_mem_needs"),
    "zero3": ("deepspeed/runtime/zero/stage3.py", "estimate_zero3_model_states_mem_needs"),
}

# (name, total parameters, largest layer's parameters). The largest layer of a GPT is its token
# embedding (vocabulary 50257 for the GPT-2/3 tokenizer) times d_model: 768, 2048, 5120.
MODELS = [
    ("gpt-125M", 125_239_296, 50257 * 768),
    ("gpt-1.3B", 1_315_575_808, 50257 * 2048),
    ("gpt-13B", 12_850_000_000, 50257 * 5120),
    ("zeroflax-main-job", 840_448, 65_536),
]
GPUS_PER_NODE = [1, 4, 8, 16]
NODES = [1, 2, 4]
BUFFER_FACTORS = [1.0, 1.5]
RETURNS = {"zero2": ["cpu_mem per node", "gpu_mem per GPU"],
           "zero3": ["cpu_mem per node", "gpu_mem per GPU", "largest_layer_memory"]}


def load_function(git_dir: str, commit: str, path: str, name: str):
    """DeepSpeed's function `name` from `path` at `commit`, executed on its own (no imports needed)."""
    source = subprocess.run(["git", "-C", git_dir, "show", f"{commit}:{path}"], check=True,
                            capture_output=True, text=True).stdout
    tree = ast.parse(source)
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name]
    if len(found) != 1:
        raise SystemExit(f"{path}@{commit}: expected one definition of {name}, found {len(found)}")
    namespace: dict = {}
    exec(compile(ast.Module(body=found, type_ignores=[]), f"{path}:{name}", "exec"), namespace)
    return namespace[name]


def grid():
    """Yield (function key, kwargs) over the grid."""
    for (model, total, largest), gpus, nodes, factor in itertools.product(MODELS, GPUS_PER_NODE, NODES,
                                                                         BUFFER_FACTORS):
        common = dict(total_params=total, num_gpus_per_node=gpus, num_nodes=nodes, additional_buffer_factor=factor)
        for cpu_offload in (False, True):
            yield model, "zero2", dict(common, cpu_offload=cpu_offload)
        for cpu_offload, cpu_offload_params, zero_init in itertools.product((False, True), repeat=3):
            yield model, "zero3", dict(common, largest_layer_params=largest, cpu_offload=cpu_offload,
                                       cpu_offload_params=cpu_offload_params, zero_init=zero_init)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("git_dir", help="a DeepSpeed git directory (bare mirrors work)")
    ap.add_argument("--commit", default="HEAD")
    ap.add_argument("--out", default="tests/data/deepspeed_estimates.json")
    args = ap.parse_args()

    commit = subprocess.run(["git", "-C", args.git_dir, "rev-parse", args.commit], check=True,
                            capture_output=True, text=True).stdout.strip()
    functions = {key: load_function(args.git_dir, commit, path, name) for key, (path, name) in FILES.items()}
    tables = {key: dict(arguments=None, returns=RETURNS[key], rows=[]) for key in FILES}
    for model, key, kwargs in grid():
        result = functions[key](**kwargs)
        table = tables[key]
        table["arguments"] = table["arguments"] or ["model", *kwargs]
        table["rows"].append([model, *kwargs.values(), *result])
    meta = dict(source=f"deepspeedai/DeepSpeed@{commit}", generator="tools/gen_deepspeed_estimates.py",
                functions={key: f"{path}:{name}" for key, (path, name) in FILES.items()},
                rows="per function: the case's arguments in the order of `arguments`, then what it returned")
    with open(args.out, "w") as f:  # one case per line: compact, and a diff reads case by case
        f.write('{"meta": ' + json.dumps(meta) + ",\n")
        for i, (key, table) in enumerate(tables.items()):
            f.write(f' "{key}": {{"arguments": {json.dumps(table["arguments"])}, "returns": '
                    f'{json.dumps(table["returns"])}, "rows": [\n')
            f.write(",\n".join(json.dumps(row) for row in table["rows"]))
            f.write("\n]}" + ("," if i + 1 < len(tables) else "") + "\n")
        f.write("}\n")
    cases = sum(len(t["rows"]) for t in tables.values())
    print(f"wrote {args.out}: {cases} cases from {meta['source']}")


if __name__ == "__main__":
    main()

"""The package's import graph, read from the source, and the layer order it must respect (docs/design.md
section 9). A module may import modules of its own layer or below, never above; no cycles; no module takes
another's private (underscore) names. Function-level imports count: a lazy import is still a dependency."""
from __future__ import annotations

import ast
import pathlib

# Lowest first. An entry names a module, a package (everything under it), or a family `name_*` (modules
# named after one: `deepspeed_zero` after `deepspeed_config`); the most specific entry places a module.
LAYERS = [
    ("foundation", ["zeroflax.version", "zeroflax.axes", "zeroflax.config", "zeroflax.config_*", "zeroflax.compat",
                    "zeroflax.workdir", "zeroflax.distributed", "zeroflax.data", "zeroflax.kernels",
                    "zeroflax.platform"]),
    ("sharding", ["zeroflax.sharding", "zeroflax.pipeline", "zeroflax.optim", "zeroflax.batch", "zeroflax.adapters",
                  "zeroflax.disk"]),
    ("step parts", ["zeroflax.step", "zeroflax.remat_choice"]),
    ("engine", ["zeroflax.engine"]),
    ("models", ["zeroflax.models"]),
    ("reports", ["zeroflax.hlo", "zeroflax.buffer_assignment", "zeroflax.comm", "zeroflax.memory",
                 "zeroflax.explain", "zeroflax.reports"]),
    ("runtime", ["zeroflax.checkpoint", "zeroflax.generate", "zeroflax.export", "zeroflax.deepspeed_*",
                 "zeroflax.train"]),
    ("planners", ["zeroflax.estimate", "zeroflax.cost", "zeroflax.plan"]),
    ("command line", ["zeroflax.command_flags", "zeroflax.estimate_command", "zeroflax.plan_command",
                      "zeroflax.explain_command", "zeroflax.cli", "zeroflax.__main__"]),
    ("package face", ["zeroflax"]),
]


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """{dotted module name: file} of the package under `root` (the repository)."""
    names = {}
    for path in sorted((root / "zeroflax").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def layer_of(module: str) -> int:
    best = None  # (rank, specificity)
    for rank, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry.endswith("_*"):
                hit = module.startswith(entry[:-1])
            else:
                hit = module == entry or module.startswith(entry + ".")
            if hit and (best is None or len(entry) > best[1]):
                best = (rank, len(entry))
    if best is None:
        raise KeyError(f"{module} is in no layer of tests/import_layers.py: place it")
    return best[0]


def _target(name: str, modules: dict) -> str | None:
    """The package module `name` denotes, or None outside the package."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(modules: dict[str, pathlib.Path]) -> tuple[dict[str, set[str]], list[str]]:
    """({module: the package modules it imports}, ['module: private name taken from another module'])."""
    graph, private = {m: set() for m in modules}, []
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [_target(alias.name, modules) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = []
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in modules:  # a submodule: `from zeroflax import kernels`
                        targets.append(full)
                        continue
                    targets.append(_target(base, modules))
                    if alias.name.startswith("_") and not alias.name.endswith("__") and targets[-1] and targets[-1] != module:
                        private.append(f"{module}: {alias.name} from {targets[-1]}")
            else:
                continue
            graph[module].update(t for t in targets if t and t != module)
    return graph, private


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found

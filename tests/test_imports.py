"""Imports run downward (docs/design.md section 9): the layering of tests/import_layers.py holds for the
package as it is, and the check catches an upward import planted in a copy of it."""
import pathlib
import shutil

from import_layers import LAYERS, cycles, imports, layer_of, module_names, upward

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_module_has_a_layer():
    for module in module_names(ROOT):
        layer_of(module)  # KeyError names the module to place


def test_no_upward_import_no_cycle_no_private_name():
    graph, private = imports(module_names(ROOT))
    assert upward(graph) == []
    assert cycles(graph) == []
    assert private == []


def test_core_imports_nothing_from_reports_planners_or_the_command_line():
    graph, _ = imports(module_names(ROOT))
    core = [m for m in graph if layer_of(m) <= [name for name, _ in LAYERS].index("engine")]
    above = {"zeroflax.memory", "zeroflax.comm", "zeroflax.explain", "zeroflax.plan", "zeroflax.estimate",
             "zeroflax.cost", "zeroflax.cli", "zeroflax"}
    assert core and not {(m, t) for m in core for t in graph[m] if t in above}


def test_a_planted_upward_import_is_caught(tmp_path):
    shutil.copytree(ROOT / "zeroflax", tmp_path / "zeroflax", ignore=shutil.ignore_patterns("__pycache__"))
    engine = tmp_path / "zeroflax" / "engine.py"
    engine.write_text(engine.read_text() + "\n\ndef _report():\n    from zeroflax.cli import main\n    return main\n")
    batch = tmp_path / "zeroflax" / "batch.py"
    batch.write_text(batch.read_text() + "\nfrom zeroflax.engine import Engine  # noqa\n")
    graph, _ = imports(module_names(tmp_path))
    found = upward(graph)
    assert "zeroflax.engine (engine) imports zeroflax.cli (command line)" in found
    assert "zeroflax.batch (sharding) imports zeroflax.engine (engine)" in found
    assert cycles(graph) == [] or all("zeroflax.batch" in c for c in cycles(graph))


def test_a_planted_cycle_and_private_import_are_caught(tmp_path):
    shutil.copytree(ROOT / "zeroflax", tmp_path / "zeroflax", ignore=shutil.ignore_patterns("__pycache__"))
    mesh = tmp_path / "zeroflax" / "sharding" / "mesh.py"
    mesh.write_text(mesh.read_text() + "\nfrom zeroflax.sharding.policy import _planted  # noqa\n")
    graph, private = imports(module_names(tmp_path))
    assert any({"zeroflax.sharding.mesh", "zeroflax.sharding.policy"} <= set(c) for c in cycles(graph))
    assert "zeroflax.sharding.mesh: _planted from zeroflax.sharding.policy" in private

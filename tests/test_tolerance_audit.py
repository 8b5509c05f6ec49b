"""The tolerance log and its audit: .ci/run reruns under a narrower instruction set exactly the tests that
tools/tolerance_audit.py --tests names from the native run's log, so a log line that names no runnable test,
or a rounding bound left out of that list, would silently drop a test from the second instruction set."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

import tolerance

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_audit():
    """tools/ is not a package: the audit is loaded from its file, once."""
    spec = importlib.util.spec_from_file_location("tolerance_audit", ROOT / "tools" / "tolerance_audit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


audit = _load_audit()


def _row(test, kind, measured, bound=1.0, isa="native", what="relative error"):
    return {"site": "test_x.py::f", "what": what, "test": test, "measured": measured, "bound": bound,
            "kind": kind, "isa": isa}


@pytest.mark.parametrize("case", ["a b"])  # a parameter with a space: the node id must still come back whole
def test_a_check_is_logged_under_the_node_id_that_reruns_it(tmp_path, monkeypatch, request, case):
    log = tmp_path / "log.jsonl"
    monkeypatch.setattr(tolerance, "LOG", str(log))
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=SSE4_2")
    tolerance.at_most(0.5, 1.0, "relative error")
    tolerance.claim(0.9, 1.0, "loss last / first")
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["test"] for r in rows] == [request.node.nodeid] * 2
    assert {r["isa"] for r in rows} == {"SSE4_2"}
    assert rows[0]["site"] == "test_tolerance_audit.py::test_a_check_is_logged_under_the_node_id_that_reruns_it"
    assert audit.rounding_tests(rows) == [request.node.nodeid]


def test_the_rerun_list_holds_the_rounding_bounds_and_not_the_claims(tmp_path, capsys):
    rows = [_row("t.py::upper", "at_most", 0.1), _row("t.py::lower", "at_least", 5.0),
            _row("t.py::claim_only", "claim", 0.5), _row("t.py::ratio_only", "info", 2.0),
            _row("", "at_most", 0.1), _row("t.py::upper", "at_most", 0.2)]
    assert audit.rounding_tests(rows) == ["t.py::lower", "t.py::upper"]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert audit.main([str(path), "--tests"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["t.py::lower", "t.py::upper"]
    path.write_text(json.dumps(_row("t.py::claim_only", "claim", 0.5)) + "\n")
    assert audit.main([str(path), "--tests"]) == 1  # nothing to rerun: CI fails rather than rerun nothing


def test_a_margin_under_the_line_is_listed_on_the_instruction_set_that_shows_it(tmp_path, capsys):
    rows = [_row("t.py::a", "at_most", 0.1, isa="native"), _row("t.py::a", "at_most", 0.4, isa="SSE4_2"),
            _row("t.py::b", "at_least", 30.0, bound=8.0, what="wrong engine / bound")]
    assert audit.margin(rows[0]) == pytest.approx(10.0)
    assert audit.margin(rows[1]) == pytest.approx(2.5)
    assert audit.margin(rows[2]) == pytest.approx(3.75)
    text, low = audit.tables(rows, under=3.0)
    assert low == ["test_x.py::f: relative error (2.5x)"]
    line = next(line for line in text.splitlines() if line.startswith("| test_x.py::f: relative error"))
    assert "10x" in line and "2.5x" in line  # each instruction set's own margin
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert audit.main([str(path), "--under", "3"]) == 1
    assert audit.main([str(path), "--under", "2"]) == 0


def test_below_keeps_the_tests_with_a_narrow_margin_on_any_of_their_bounds(tmp_path, capsys):
    """CI reruns under SSE4.2 only the tests with a bound under 30x natively: a test with one narrow
    bound among wide ones is kept, one whose every bound is wide is left out, a lower bound counts by
    its own margin (measured over bound)."""
    rows = [_row("t.py::narrow", "at_most", 0.1), _row("t.py::narrow", "at_most", 0.05),  # 10x, 20x
            _row("t.py::wide", "at_most", 0.001), _row("t.py::mixed", "at_most", 0.001),  # 1000x
            _row("t.py::mixed", "at_most", 0.5),  # 2x
            _row("t.py::lower_wide", "at_least", 500.0), _row("t.py::lower_narrow", "at_least", 5.0)]
    assert audit.rounding_tests(rows, below=30) == ["t.py::lower_narrow", "t.py::mixed", "t.py::narrow"]
    assert audit.rounding_tests(rows) == ["t.py::lower_narrow", "t.py::lower_wide", "t.py::mixed", "t.py::narrow",
                                          "t.py::wide"]
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert audit.main([str(path), "--tests", "--below", "30"]) == 0
    assert capsys.readouterr().out.split() == ["t.py::lower_narrow", "t.py::mixed", "t.py::narrow"]
    assert audit.main([str(path), "--tests", "--below", "1.5"]) == 1  # nothing that narrow: CI fails, reruns nothing

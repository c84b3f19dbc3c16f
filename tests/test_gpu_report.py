"""The GPU tests' error report (tests/gpu/conftest.py) is written test by test, so a timed-out run keeps it."""

from __future__ import annotations

import json
import types

from tests.gpu import conftest
from tests.gpu.common import REPORT


def _report(nodeid, when, outcome, duration=0.5):
    return types.SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=duration,
                                 failed=outcome == "failed")


def test_report_lines_are_written_as_each_test_ends(tmp_path, monkeypatch):
    path = tmp_path / "report"
    monkeypatch.setenv("HF_FASTPATH_GPU_REPORT", str(path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setattr(conftest, "_WRITES", [True])
    REPORT.clear()
    REPORT.append(dict(case="a", max_err=1e-3))
    conftest.pytest_runtest_logreport(_report("t.py::a", "setup", "passed"))  # nothing yet
    conftest.pytest_runtest_logreport(_report("t.py::a", "call", "passed"))
    assert not REPORT  # handed over to the file
    conftest.pytest_runtest_logreport(_report("t.py::a", "teardown", "passed"))
    conftest.pytest_runtest_logreport(_report("t.py::b", "setup", "failed"))  # an error at setup is news
    lines = [json.loads(x) for x in (tmp_path / "report.gw3").read_text().splitlines()]
    assert [(x["test"], x["when"], x["outcome"]) for x in lines] == [("t.py::a", "call", "passed"),
                                                                     ("t.py::b", "setup", "failed")]
    assert lines[0]["cases"] == [dict(case="a", max_err=1e-3)] and lines[1]["cases"] == []


def test_no_report_without_the_variable_or_in_an_xdist_controller(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_FASTPATH_GPU_REPORT", raising=False)
    conftest.pytest_runtest_logreport(_report("t.py::a", "call", "passed"))
    monkeypatch.setenv("HF_FASTPATH_GPU_REPORT", str(tmp_path / "r"))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.setattr(conftest, "_WRITES", [True])
    conftest.pytest_configure(types.SimpleNamespace(option=types.SimpleNamespace(numprocesses=8)))  # controller
    conftest.pytest_runtest_logreport(_report("t.py::a", "call", "passed"))
    assert conftest._WRITES == [False] and list(tmp_path.iterdir()) == []
    conftest.pytest_configure(types.SimpleNamespace(option=types.SimpleNamespace(numprocesses=None)))  # no xdist
    conftest.pytest_runtest_logreport(_report("t.py::a", "call", "passed"))
    assert [p.name for p in tmp_path.iterdir()] == ["r"]

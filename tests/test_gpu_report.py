"""The GPU tests' error report (tests/gpu/conftest.py) is written test by test, so a timed-out run keeps it."""

from __future__ import annotations

import json
import types

import pytest
import torch

from tests.gpu import conftest
from tests.gpu.common import REPORT, check_finite


def _report(nodeid, when, outcome, duration=0.5):
    return types.SimpleNamespace(nodeid=nodeid, when=when, outcome=outcome, duration=duration,
                                 failed=outcome == "failed", longreprtext="AssertionError: dq has NaN/inf")


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
    # a failure says why in its line: the run's own output may be cut off by its time limit
    assert "error" not in lines[0] and lines[1]["error"] == "AssertionError: dq has NaN/inf"


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


def test_check_finite_reports_where_the_nans_sit_and_keeps_the_tensors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_FASTPATH_GPU_REPORT", str(tmp_path / "report"))
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    REPORT.clear()
    q = torch.randn(2, 5, 3)
    check_finite("fine", dict(dq=q.clone()), q=q)  # finite: nothing recorded
    assert REPORT == []
    dq = q.clone()
    dq[1, 4, 0] = float("nan")
    dq[1, 2, 2] = float("inf")
    with pytest.raises(AssertionError, match="case x: dq has NaN/inf"):
        check_finite("case x", dict(dq=dq, dk=q), q=q, window_size=(4, -1))
    (record,) = REPORT
    assert record["nonfinite"] == dict(dq=dict(count=2, shape=[2, 5, 3], dim0=[1], dim1=[2, 4], dim2=[0, 2]))
    saved = torch.load(record["saved"])
    assert set(saved) == {"q", "window_size", "dq"} and saved["window_size"] == (4, -1)
    assert torch.equal(saved["q"], q) and torch.equal(saved["dq"].isnan(), dq.isnan())
    REPORT.clear()

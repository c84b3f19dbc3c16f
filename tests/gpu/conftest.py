"""With HF_FASTPATH_GPU_REPORT=path, each GPU test's error records (`tests.gpu.common.REPORT`) go to path as one
JSON line per test when the test ends ({"test", "outcome", "when", "seconds", "cases"}; path.gw0, path.gw1, ...
per pytest-xdist worker), so a run cut short by a time limit keeps what it measured and shows which tests ran."""

import json
import os

from tests.gpu.common import REPORT

_WRITES = [True]  # False in a pytest-xdist controller, which is handed every worker's reports too


def report_path():
    path = os.environ.get("HF_FASTPATH_GPU_REPORT")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{path}.{worker}" if path and worker else path


def pytest_configure(config):
    _WRITES[0] = not (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"))


def pytest_runtest_logreport(report):
    path = report_path()
    if not path or not _WRITES[0] or (report.when != "call" and not report.failed):  # setup / teardown: errors only
        return
    line = dict(test=report.nodeid, outcome=report.outcome, when=report.when, seconds=round(report.duration, 3),
                cases=list(REPORT))
    REPORT.clear()
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")

"""With HF_FASTPATH_GPU_REPORT=path, each GPU test's error records (`tests.gpu.common.REPORT`) go to path as one
JSON line per test when the test ends ({"test", "outcome", "when", "seconds", "cases"}, and a failure's "error"
text; path.gw0, path.gw1, ... per pytest-xdist worker), so a run cut short by a time limit keeps what it measured,
which tests ran and why one failed."""

import json

from tests.gpu.common import REPORT, report_path

_WRITES = [True]  # False in a pytest-xdist controller, which is handed every worker's reports too


def pytest_configure(config):
    _WRITES[0] = not (getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"))


def pytest_runtest_logreport(report):
    path = report_path()
    if not path or not _WRITES[0] or (report.when != "call" and not report.failed):  # setup / teardown: errors only
        return
    line = dict(test=report.nodeid, outcome=report.outcome, when=report.when, seconds=round(report.duration, 3),
                cases=list(REPORT))
    if report.failed:  # which assertion, even when the run's own output is cut off by its time limit
        line["error"] = report.longreprtext[-3000:]
    REPORT.clear()
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")

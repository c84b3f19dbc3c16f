import json
import os

from tests.gpu.common import REPORT


def pytest_sessionfinish(session):
    path = os.environ.get("HF_FASTPATH_GPU_REPORT")
    if path and REPORT:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{path}.{worker}" if worker else path, "w") as f:
            json.dump(REPORT, f, indent=1)

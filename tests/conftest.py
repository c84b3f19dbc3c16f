import os

# Run the real Triton kernels on the CPU (CI has no GPU). Must be set before triton.jit decorates anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

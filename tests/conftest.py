"""Fixtures: a tiny randomly initialised Llama, the embedded SmolLM2-135M, and the test markers.

Markers (declared in pyproject.toml): ``embedded`` for tests that load the embedded model, ``slow`` for tests
that take more than a few seconds. ``make test-fast`` runs everything else.
"""

from __future__ import annotations

import os

import pytest

# Triton's kernels run on a CPU in its interpreter, which it reads when it is imported (tests/test_triton_attention.py)
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.helpers import make_tiny_llama


@pytest.fixture
def isolated_cache(tmp_path_factory, monkeypatch):
    """A test cache directory (``HSD_CACHE``), and torch's process-wide thread count restored after the test (a
    profile's ``--threads 1`` sets it)."""
    import torch

    monkeypatch.setenv("HSD_CACHE", str(tmp_path_factory.getbasetemp() / "hsd-cache"))
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests (restored after): tiny models run about 25x faster on one thread than
    with OpenMP threads fighting over 2 shared cores. A module asks for it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture(scope="session")
def embedded():
    """The embedded default model (SmolLM2-135M-Instruct), loaded once per session on the CPU.

    `make test` installs it first (`make model`); a missing model is a failure, not a skip, so the lossless
    tests on it always run.
    """
    from hsd_opt.models.loading import load_model

    return load_model("smollm2-135m", device="cpu", dtype="float32")


def pytest_collection_modifyitems(config, items):
    """Every test that uses the embedded model (directly or through a fixture) is marked ``embedded``."""
    for item in items:
        if "embedded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.embedded)

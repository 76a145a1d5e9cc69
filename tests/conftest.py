"""Shared fixtures: the tiny random Llama (built from a config, no download) and marker-based skips."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# One intra-op thread: the tests' models are tiny, where a second thread only adds synchronisation (measured ~10x
# slower with two threads on a loaded 2-core machine); subprocess tests set OMP_NUM_THREADS=1 themselves.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """Skip gpu/vllm tests on machines that cannot run them."""
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    no_vllm = pytest.mark.skip(reason="needs vllm (pip install 'vpo-lightning[vllm]')")
    for item in items:
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():  # not keywords: they hold path names
            item.add_marker(no_cuda)
        if item.get_closest_marker("vllm") and importlib.util.find_spec("vllm") is None:
            item.add_marker(no_vllm)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The ``tiny-llama`` alias: a 2-layer random Llama with SmolLM2's tokenizer, built once and cached."""
    from vpo_lightning.models import resolve_model_path

    return Path(resolve_model_path("tiny-llama"))


@pytest.fixture()
def in_repo(monkeypatch):
    """Run with the repository root as the working directory (configs use repo-relative paths)."""
    monkeypatch.chdir(REPO)
    return REPO


@pytest.fixture(autouse=True)
def _quiet_tokenizers():
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture()
def one_thread():
    """One torch intra-op thread: the tiny model's ops are so small that on a busy CPU a thread pool only adds
    waiting. Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

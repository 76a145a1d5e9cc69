"""Shared fixtures: the tiny random Llama (built from a config, no download) and marker-based skips."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import lightning  # noqa: F401
import pytest
import torch

from vpo_lightning.core.types import Generation
from vpo_lightning.generation.engines import Engine

REPO = Path(__file__).resolve().parents[1]
# The sandbox refuses to run when this machine lacks one of its layers, unless the user accepts that layer by name
# (issue 54). Test machines without writable cgroups (an unprivileged user; cgroup v2 without delegation) accept that
# one: the tests that need per-run cgroups skip there, and the tests of the refusal itself unset this.
os.environ.setdefault("VPO_SANDBOX_ALLOW_MISSING", "cgroups")

# One intra-op thread: the tests' models are tiny, where a second thread only adds synchronisation (measured ~10x
# slower with two threads on a loaded 2-core machine); subprocess tests set OMP_NUM_THREADS=1 themselves.
torch.set_num_threads(1)
# Lightning is imported above, at collection, as the `vpo` command imports it before any output: Lightning gives its
# logger a handler on the stderr of the moment of its import when the root logger has none, and imported inside a
# test that would be the test's capsys stream, closed after it ("--- Logging error ---" in later tests).


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
    from vpo_lightning.generation.models import resolve_model_path

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


# ---------------------------------------------------------------------------------------------- shared test doubles
class ScriptedEngine(Engine):
    """The tests' one engine double: returns scripted completions instead of sampling from the policy.

    Args:
        script: completions, cycled over the N = B * G chains of a call; or ``fn(prompt_text, row) -> text`` called
            for each chain (``row`` = its index in the call).
        lengths: give each chain ``lengths[n]`` random token ids (seeded) instead of the encoding of its text; for
            tests of loss shapes and empty completions.

    Every call's prompt ids are kept in ``prompts``.
    """

    def __init__(self, script, lengths=None) -> None:
        self.script, self.lengths, self.prompts = script, lengths, []

    def generate(self, module, prompt_ids, group_size, sampling, seeds=None):
        self.prompts.append(prompt_ids)
        n = len(prompt_ids) * group_size
        if callable(self.script):
            texts = [self.script(module.tokenizer.decode(prompt_ids[i // group_size]), i) for i in range(n)]
        else:
            texts = [self.script[i % len(self.script)] for i in range(n)]
        if self.lengths is not None:
            assert len(self.lengths) == n, f"{len(self.lengths)} lengths for {n} chains"
            g = torch.Generator().manual_seed(1)
            ids = [torch.randint(10, 1000, (k,), generator=g).tolist() for k in self.lengths]
        else:
            ids = [module.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        return Generation(ids, texts, sum(map(len, ids)))


@pytest.fixture()
def scripted_engine():
    """The :class:`ScriptedEngine` class (construct it with a script)."""
    return ScriptedEngine


@pytest.fixture()
def script_generation(monkeypatch):
    """``script_generation(script)``: every ``TransformersEngine`` (the one `vpo eval`/`vpo search` build) answers
    from ``script`` instead of sampling; returns the :class:`ScriptedEngine` that does it."""
    from vpo_lightning.generation.engines import TransformersEngine

    def patch(script, lengths=None) -> ScriptedEngine:
        engine = ScriptedEngine(script, lengths)
        monkeypatch.setattr(TransformersEngine, "generate", lambda self, *args, **kw: engine.generate(*args, **kw))
        return engine

    return patch


def build_tiny_module(*, lora_b_std: float = 0.1, lora_b_seed: int | None = None, attn: str = "sdpa",
                      checkpointing: bool = False, beta: float | None = None, **optim):
    """A configured ``VPOModule`` on the tiny model with a non-zero adapter (so policy and reference differ)."""
    from vpo_lightning.generation.models import LoraSettings, ModelSettings
    from vpo_lightning.training.module import LossSettings, OptimSettings, VPOModule

    loss = LossSettings() if beta is None else LossSettings(beta=beta)
    module = VPOModule(ModelSettings(name="tiny-llama", dtype="fp32", attn_implementation=attn,
                                     gradient_checkpointing=checkpointing, lora=LoraSettings(r=4)),
                       loss=loss, optim=OptimSettings(**optim))
    module.configure_model()
    with torch.no_grad():
        for n, p in module.policy.named_parameters():
            if "lora_B" in n:  # lora_b_seed: each adapter matrix drawn from a generator with that seed
                gen = None if lora_b_seed is None else torch.Generator().manual_seed(lora_b_seed)
                p.normal_(std=lora_b_std, generator=gen)
    return module


@pytest.fixture()
def tiny_module():
    """``tiny_module(**kw)``: :func:`build_tiny_module` (the tiny model's VPOModule with a non-zero adapter)."""
    return build_tiny_module

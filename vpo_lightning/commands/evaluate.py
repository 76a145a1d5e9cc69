"""``vpo eval``: sample a pool of n solutions per test prompt and compute the metrics of VPO-SPEC section 6.

    vpo eval --config configs/tooluse.yaml                                        # the base model
    vpo eval --config configs/tooluse.yaml --ckpt checkpoints/tooluse-vpo/last.ckpt
    vpo eval --config configs/tooluse_grpo.yaml --adapter checkpoints/tooluse-grpo/adapters/last --n 12

Every method gets the same solution budget: n solutions per prompt are n / m chains of m answers for chain methods
(vpo, multi_rlvr) and n single answers otherwise; k in best@k and pass@k counts solutions, not chains. The prompts
are a seeded sample (``--prompt_seed``) of the split, so models evaluated with the same arguments see the same
prompts. Outputs (``--out``): ``eval.json`` (settings, per-prompt and aggregate metrics), ``samples.jsonl`` (every
completion with its reward vectors) and PNG plots (best@k, pass@k, diversity). An output folder that already holds an
evaluation is refused (``--overwrite`` replaces it whole), so two evaluations never share a file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from vpo_lightning.app import parse_args, run_command
from vpo_lightning.commands.runs import (
    add_run_args,
    event_files,
    find_config,
    load_config,
    load_model,
    pick_device,
    read_scalars,
    run_config,
)
from vpo_lightning.generation.adapters import refresh_card
from vpo_lightning.training.config import get
from vpo_lightning.training.sampler import Sampler

log = logging.getLogger(__name__)

FORMAT = "vpo-eval/1"
NUM_WEIGHTS = 100  # Dirichlet weights for E_w[max w.v] (VPO-SPEC section 6)


# ---- arguments and configuration -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``vpo eval`` argument parser."""
    p = argparse.ArgumentParser(prog="vpo eval", description="Sample n solutions per test prompt and compute "
                                "best@k, pass@k, diversity, E_w best and the Pareto fraction (VPO-SPEC section 6).")
    add_run_args(p)
    p.add_argument("--split", choices=("test", "val"), default="test",
                   help="which split of the config's data (default: test)")
    p.add_argument("--data_file", help="JSONL prompts to evaluate on (overrides --split)")
    p.add_argument("--n", type=int, default=12, help="solutions per prompt; chain methods: n / m chains (default: 12)")
    p.add_argument("--max_prompts", type=int, default=20,
                   help="prompts to evaluate, a seeded sample of the split (default: 20)")
    p.add_argument("--max_prompt_tokens", type=int, default=None,
                   help="skip longer prompts (default: the config's data.max_prompt_tokens; 0 = keep all)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed, also of best@k orders and E_w weights (default: 0)")
    p.add_argument("--prompt_seed", type=int, default=0,
                   help="seed of the prompt sample; keep it fixed across models (default: 0)")
    p.add_argument("--estimator", help="override rollout.estimator (decides chain vs single-answer prompting)")
    p.add_argument("--label", help="name of this run in `vpo compare` (default: from the run name and weights)")
    p.add_argument("--out", help="output directory (default: beside --ckpt/--adapter, else "
                                 "checkpoints/eval-<config stem>/; with --estimator, its name is appended)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier evaluation in the output directory (else it is refused)")
    p.add_argument("--prompts_per_call", type=int, default=4,
                   help="prompts batched into one generate call (default: 4)")
    p.add_argument("--orders", type=int, default=100, help="random pool orders averaged in best@k (default: 100)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--from_samples", metavar="EVAL_DIR",
                   help="sample nothing: recompute the metrics from the first n solutions (n / m chains, in sampling "
                        "order) of each prompt of an earlier `vpo eval` output (its samples.jsonl), e.g. a 24-sample "
                        "evaluation reported at the n = 12 of other runs; loads no model")
    return p


def default_data_file(cfg: dict[str, Any], split: str) -> str:
    """The split's JSONL: ``data.val_files[0]`` for val, else the first train file with ``train`` -> split."""
    if split == "val" and get(cfg, "data.val_files"):
        return str(get(cfg, "data.val_files")[0])
    train = get(cfg, "data.train_files") or []
    if not train:
        raise ValueError("the config has no data.train_files to derive the split from: pass --data_file")
    path = Path(train[0])
    name = path.name.replace("train", split) if "train" in path.name else f"{split}{path.suffix or '.jsonl'}"
    return str(path.with_name(name))


def prompts_file(cfg: Any, args: argparse.Namespace, command: str = "vpo eval") -> str:
    """``--data_file``, else the split's file (:func:`default_data_file`), which must exist: a custom task's data
    rarely has a ``test`` file beside its ``train`` file, and the fix is ``--data_file``, not the config."""
    if args.data_file:
        return str(args.data_file)
    path = default_data_file(cfg, args.split)
    if not Path(path).exists():
        train = (get(cfg, "data.train_files") or ["?"])[0]
        raise FileNotFoundError(f"{command} --split {args.split}: no {path} (the {args.split} file derived from "
                                f"data.train_files {train}); give the prompts to evaluate with --data_file FILE "
                                "(JSONL, JSON, Parquet, CSV or a save_to_disk folder)"
                                + ("" if args.split == "val" else ", or --split val for data.val_files"))
    return path


def default_out_dir(args: argparse.Namespace, config: Path) -> Path:
    """Beside the checkpoint or adapter (``eval-<name>``), else ``checkpoints/eval-<config stem>``; ``-<split>``
    for a split other than test, ``-<estimator>`` for ``--estimator``."""
    suffix = "" if args.split == "test" or args.data_file else f"-{args.split}"
    suffix += f"-{args.estimator}" if getattr(args, "estimator", None) else ""
    if args.ckpt:
        return Path(args.ckpt).parent / f"eval-{Path(args.ckpt).stem}{suffix}"
    if args.adapter:
        adapter = Path(args.adapter)
        return adapter.parent / f"eval-{adapter.name}{suffix}"
    return Path("checkpoints") / f"eval-{config.stem}{suffix}"


# ---- prompts --------------------------------------------------------------------------------------------------
def select_prompts(records: list[dict], tokenizer: Any, max_prompts: int, max_tokens: int, seed: int) -> list[dict]:
    """A seeded random sample of ``max_prompts`` records whose chat prompt has at most ``max_tokens`` tokens."""
    from vpo_lightning.generation.models import prompt_token_ids
    from vpo_lightning.training.records import template_tools

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    picked: list[dict] = []
    for i in order:
        ids = prompt_token_ids(tokenizer, records[i]["messages"], template_tools(records[i])) if max_tokens else []
        if max_tokens and len(ids) > max_tokens:
            continue
        picked.append(records[i])
        if len(picked) == max_prompts:
            break
    if not picked:
        raise ValueError(f"no prompt has at most {max_tokens} tokens: raise --max_prompt_tokens (0 = keep all)")
    return picked


# ---- sampling -------------------------------------------------------------------------------------------------
@dataclass
class PromptPool:
    """One prompt's sampled pool: C chains of m candidates (C = n / m; m = 1 for single-answer methods)."""

    record: dict
    rewards: Tensor  # [C, m, D], zero rows where absent
    mask: Tensor  # [C, m] bool, True = candidate present
    texts: list[str]  # C completions
    tokens: int  # generated tokens over the C completions
    errors: int  # reward calls that failed (scored 0); counted per engine call, on its first prompt
    dims: Tensor | None = None  # [D] bool, the record's real dimensions (code: its tests); None = all D

    def real_rewards(self) -> Tensor:
        """``rewards [C, m, D']`` on the record's real dimensions only (D' = D when every dimension is real)."""
        return self.rewards if self.dims is None else self.rewards[..., self.dims]


def eval_sampler(cfg: dict[str, Any] | Any, estimator: str | None = None) -> Sampler:
    """The :class:`~vpo_lightning.training.sampler.Sampler` of ``vpo eval`` and ``vpo search``: the config's chain
    protocol (its ``rollout:`` section parsed as `vpo fit` parses it: ``vpo_lightning.commands.runs.run_config``;
    ``estimator`` overrides ``rollout.estimator``) with the evaluation engine and sampling (:func:`build_engine`)."""
    run = _run_config(cfg, estimator)
    return Sampler(run.protocol(), *build_engine(run))


def _run_config(cfg: dict[str, Any] | Any, estimator: str | None = None) -> Any:
    """``cfg`` (a loaded config or a parsed ``RunConfig``) as a ``RunConfig``."""
    from vpo_lightning.training.config import RunConfig

    return cfg if isinstance(cfg, RunConfig) else run_config(cfg, estimator=estimator)


def build_engine(cfg: dict[str, Any] | Any) -> tuple[Any, Any]:
    """``(engine, sampling)``: a ``TransformersEngine`` with the config engine's ``max_batch_size`` (0 where the
    engine has none, e.g. vLLM), and the evaluation sampling settings (``RunConfig.eval_sampling``: the training
    ``sampling`` at ``eval.temperature`` and ``eval.top_p``), as the reference evaluates held-out pools."""
    from vpo_lightning.generation.engines import TransformersEngine

    run = _run_config(cfg)
    return TransformersEngine(int(run.engine_args().get("max_batch_size", 0) or 0)), run.eval_sampling()


def sample_batch(ns: Any, run: Sampler, records: list[dict], chains: int, seed: int, call: int) -> list[PromptPool]:
    """One engine call for all chains of ``records``; split the scored result back per prompt."""
    gen = run.generate_chains(ns, records, chains, seed, "eval", call)
    cands = [run.protocol.candidates(t) for t in gen.texts]
    scores = run.protocol.score(cands, [rec for rec in records for _ in range(chains)])
    pools = []
    for i, rec in enumerate(records):
        sl = slice(i * chains, (i + 1) * chains)
        tokens = sum(len(c) for c in gen.completion_ids[sl])
        dims = None if scores.dim_mask is None else scores.dim_mask[i * chains]  # [D] the record's real dims
        pools.append(PromptPool(rec, scores.rewards[sl], scores.mask[sl], gen.texts[sl], tokens,
                                scores.num_errors if i == 0 else 0, dims))
    return pools


def sample_pools(ns: Any, run: Sampler, records: list[dict], chains: int, seed: int, per_call: int) -> list[PromptPool]:
    """Sample every prompt's pool, ``per_call`` prompts per engine call, with a rich progress bar and ETA."""
    from rich import progress as rp

    pools: list[PromptPool] = []
    columns = (rp.TextColumn("eval"), rp.BarColumn(), rp.MofNCompleteColumn(), rp.TextColumn("prompts"),
               rp.TimeElapsedColumn(), rp.TextColumn("ETA"), rp.TimeRemainingColumn())
    with rp.Progress(*columns) as progress:
        task = progress.add_task("eval", total=len(records))
        for call, start in enumerate(range(0, len(records), per_call)):
            batch = records[start : start + per_call]
            pools += sample_batch(ns, run, batch, chains, seed, call)
            progress.advance(task, len(batch))
    return pools


# ---- metrics --------------------------------------------------------------------------------------------------
def _floats(t: Tensor) -> list[float]:
    return [round(float(v), 6) for v in t]


def prompt_metrics(pool: PromptPool, seed: int, orders: int, f_weights: list[float] | None = None) -> dict[str, Any]:
    """Section 6 metrics of one prompt's pool (absent candidates count as zero-reward solutions in best@k, whose
    scalar f is the mean over dimensions, or the weighted mean with the task's ``f_weights``). With per-record D
    (``pool.dims``) every metric reads the record's real dimensions only."""
    from vpo_lightning.core import metrics
    from vpo_lightning.core.protocol import derive_seed

    rewards = pool.real_rewards()  # [C, m, D']
    if pool.dims is not None and f_weights is not None:
        f_weights = [w for w, ok in zip(f_weights, pool.dims.tolist()) if ok]
    C, m, D = rewards.shape
    values, present = rewards.reshape(1, C * m, D), pool.mask.reshape(1, C * m)  # [1, n, D'], [1, n]
    solved = metrics.solved(rewards, pool.mask)  # [C, m]
    key = derive_seed(seed, pool.record.get("id"))
    two = int(present.sum()) >= 2
    chain_pairs = m > 1 and bool((pool.mask.sum(-1) >= 2).any())
    return {
        "id": pool.record.get("id"), "category": (pool.record.get("meta") or {}).get("category"),
        "best_at_k": _floats(metrics.best_at_k_curve(values, seed=key, num_seeds=orders, f_weights=f_weights)),
        "pass_at_k": _floats(metrics.pass_at_k_curve(solved.reshape(1, -1))),
        "chain_pass_at_k": _floats(metrics.chain_pass_at_k_curve(solved[None])),
        "num_solved": int(solved.sum()), "num_present": int(present.sum()),
        "pairwise_l1_diversity": metrics.pairwise_l1_diversity(values, present) if two else None,
        "within_chain_diversity": metrics.within_chain_diversity(rewards[None], pool.mask[None])
        if chain_pairs else None,
        "expected_best_weighted": metrics.expected_best_weighted(
            values, NUM_WEIGHTS, generator=torch.Generator().manual_seed(key), mask=present),
        "pareto_fraction": metrics.pareto_fraction(values, present) if bool(present.any()) else None,
        "generated_tokens": pool.tokens,
        "rewards": [[round(float(v), 6) for v in row] for row in pool.rewards.reshape(C * m, -1)],
        "present": [bool(v) for v in present[0]],
        "real_dims": None if pool.dims is None else [bool(v) for v in pool.dims],
    }


def aggregate_metrics(pools: list[PromptPool], per_prompt: list[dict], dim_names: list[str], seed: int) -> dict:
    """Metrics over all prompts: curves averaged over prompts; set metrics from the stacked ``[P, n, D]`` pool."""
    from vpo_lightning.core import metrics

    rewards = torch.stack([p.rewards for p in pools])  # [P, C, m, D]
    mask = torch.stack([p.mask for p in pools])  # [P, C, m]
    P, C, m, D = rewards.shape
    values, present = rewards.reshape(P, C * m, D), mask.reshape(P, C * m)  # [P, n, D], [P, n]
    solved = torch.stack([metrics.solved(p.real_rewards(), p.mask) for p in pools])  # [P, C, m] on real dims
    real = torch.stack([p.dims if p.dims is not None else torch.ones(D, dtype=torch.bool) for p in pools])  # [P, D]
    varied = not bool(real.all())
    # padding dimensions are 0 for every solution, so pairwise L1 and the Pareto front are unchanged by them; the
    # weighted best and the per-dimension means must leave them out
    expected_best = (sum(r["expected_best_weighted"] for r in per_prompt) / P if varied else
                     metrics.expected_best_weighted(values, NUM_WEIGHTS, generator=torch.Generator().manual_seed(seed),
                                                    mask=present))
    mean_reward = values.mean(dim=(0, 1))  # [D] absent solutions count 0
    if varied:  # each dimension over the prompts where it is real
        mean_reward = (values.sum(dim=1) / (C * m) * real).sum(0) / real.sum(0).clamp(min=1)
    tokens = sum(p.tokens for p in pools)
    return {
        "best_at_k": _floats(torch.tensor([r["best_at_k"] for r in per_prompt]).mean(0)),
        "pass_at_k": _floats(metrics.pass_at_k_curve(solved.reshape(P, -1))),
        "chain_pass_at_k": _floats(metrics.chain_pass_at_k_curve(solved)),
        "pairwise_l1_diversity": metrics.pairwise_l1_diversity(values, present),
        "within_chain_diversity": metrics.within_chain_diversity(rewards, mask) if m > 1 else None,
        "expected_best_weighted": expected_best,
        "pareto_fraction": metrics.pareto_fraction(values, present),
        "mean_reward": dict(zip(dim_names, _floats(mean_reward))),  # absent solutions count 0
        "solved_fraction": float(solved.float().mean()),
        "present_fraction": float(present.float().mean()),
        "parse_rate": float(mask.any(-1).float().mean()),  # chains with at least one parsed candidate
        "generated_tokens": tokens,
        "tokens_per_solution": tokens / max(1, P * C * m),
        "reward_errors": sum(p.errors for p in pools),
    }


# ---- training provenance --------------------------------------------------------------------------------------
def training_tokens(weights: str | None, global_step: int | None) -> dict[str, Any] | None:
    """Optimizer steps and generated tokens of the run that wrote ``weights``, from ``train/rollout/tokens``.

    Reads the TensorBoard event files beside the checkpoint (or two levels above an adapter directory); None when
    there are none. Only steps before ``global_step`` (when known) count.
    """
    if not weights:
        return None
    path = Path(weights)
    runs = [d for d in (path.parent, path.parent.parent) if event_files(d)]
    if not runs:
        return None
    if global_step is None and path.name.startswith("step="):
        global_step = int(path.name.split("=", 1)[1].split(".")[0])
    per_step = read_scalars(runs[0]).get("train/rollout/tokens", {})
    kept = {s: v for s, v in per_step.items() if global_step is None or s < global_step}
    return {"log_dir": str(runs[0]), "optimizer_steps": global_step if global_step is not None else len(kept),
            "logged_steps": len(kept), "generated_tokens": int(sum(kept.values()))}


# ---- outputs --------------------------------------------------------------------------------------------------
def plot_curves(curves: dict[str, list[float]], ylabel: str, path: Path, title: str = "") -> None:
    """One line per entry of ``curves`` against k = 1..len, saved as a PNG (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3, label=label)
    ax.set_xlabel("k (solutions)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_bars(values: dict[str, float], ylabel: str, path: Path, title: str = "") -> None:
    """A bar chart of ``values`` saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    bars = ax.bar(list(values), list(values.values()), color="tab:blue")
    ax.bar_label(bars, fmt="%.3f")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an output directory that already holds an evaluation, unless ``overwrite``: two evaluations never
    share a file."""
    if (out / "eval.json").exists() and not overwrite:
        raise ValueError(f"{out} already holds an evaluation (eval.json): pass --out DIR for a separate one, or "
                         "--overwrite to replace it")


def write_outputs(out: Path, report: dict[str, Any], pools: list[PromptPool]) -> None:
    """eval.json, samples.jsonl and the three plots, written to a temporary folder that then replaces ``out``
    (nothing of an earlier evaluation stays beside them)."""
    final, out = out, out.with_name(f".{out.name}.tmp")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    with (out / "samples.jsonl").open("w", encoding="utf-8") as fh:
        for pool in pools:
            for c, text in enumerate(pool.texts):
                rewards = [row if ok else None for row, ok in zip(pool.rewards[c].tolist(), pool.mask[c].tolist())]
                fh.write(json.dumps({"id": pool.record.get("id"), "chain": c, "text": text, "rewards": rewards}) + "\n")
    agg, label = report["aggregate"], report["label"]
    plot_curves({label: agg["best_at_k"]}, "best@k (mean reward of the best of k)", out / "best_at_k.png", label)
    plot_curves({label: agg["pass_at_k"]}, "pass@k (unbiased)", out / "pass_at_k.png", label)
    bars = {"pool L1": agg["pairwise_l1_diversity"]}
    if agg["within_chain_diversity"] is not None:
        bars["within-chain L1"] = agg["within_chain_diversity"]
    plot_bars(bars, "reward-space diversity", out / "diversity.png", label)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(out, final)


def default_label(cfg: dict[str, Any], args: argparse.Namespace, model_name: str) -> str:
    """``<run_name>:<weights name>`` for trained weights, ``base (<model>)`` for the base model."""
    if args.label:
        return args.label
    weights = args.ckpt or args.adapter
    if weights:
        return f"{cfg.get('run_name', 'run')}:{Path(weights).stem if args.ckpt else Path(weights).name}"
    return f"base ({model_name})"


# ---- main -----------------------------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace, m: int) -> None:
    if args.n < 1 or args.max_prompts < 1 or args.prompts_per_call < 1 or args.orders < 1:
        raise ValueError("--n, --max_prompts, --prompts_per_call and --orders must be >= 1")
    if args.n % m:
        raise ValueError(f"--n {args.n} is not a multiple of m = {m} (rollout.num_candidates): the pool is n / m "
                         "chains of m solutions; pick n divisible by m")


def load_prompts(cfg: Any, args: argparse.Namespace, tokenizer: Any) -> tuple[str, int, list[dict]]:
    """``(data file, max prompt tokens, the selected records)``; ``cfg``: the parsed config (``RunConfig.parsed``,
    ``data.max_prompt_tokens`` defaulted as `vpo fit` defaults it)."""
    from vpo_lightning.training.records import read_records

    data_file = prompts_file(cfg, args)
    limit = args.max_prompt_tokens
    if limit is None:
        limit = get(cfg, "data.max_prompt_tokens")
    limit = int(limit or 0)
    records = read_records(data_file)
    return data_file, limit, select_prompts(records, tokenizer, args.max_prompts, limit, args.prompt_seed)


def build_report(args: argparse.Namespace, cfg: dict[str, Any], run: dict[str, Any], sampler: Sampler,
                 pools: list[PromptPool]) -> dict[str, Any]:
    """The eval.json content: settings and provenance, per-prompt and aggregate metrics."""
    settings, info = run["settings"], run["info"]
    proto = sampler.protocol
    f_weights = proto.reward_vector.f_weights
    per_prompt = [prompt_metrics(p, args.seed, args.orders, f_weights) for p in pools]
    dims = proto.dim_names
    return {
        "format": FORMAT, "label": default_label(cfg, args, settings.name),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": str(run["config"]), "overrides": args.overrides, "run_name": cfg.get("run_name"),
        "model": settings.name, "model_settings": asdict(settings), **info,
        "training": training_tokens(args.ckpt or args.adapter, info["global_step"]),
        "estimator": proto.estimator, "m": proto.m, "n": args.n, "chains_per_prompt": args.n // proto.m,
        "tag_family": proto.tag_family, "sampling": asdict(sampler.sampling), "dim_names": dims,
        "f_weights": f_weights,
        "rewards": proto.reward_names, "seed": args.seed, "prompt_seed": args.prompt_seed, "split": args.split,
        "data_file": run["data_file"], "max_prompt_tokens": run["limit"], "prompts_per_call": args.prompts_per_call,
        "best_at_k_orders": args.orders, "num_prompts": len(pools), "device": run["device"],
        "aggregate": aggregate_metrics(pools, per_prompt, dims, args.seed), "prompts": per_prompt,
    }


def read_samples(src: Path) -> dict[Any, list[dict]]:
    """An evaluation's ``samples.jsonl``: per prompt id, its chains' rows (``chain``, ``text``, ``rewards``) in
    sampling order."""
    import json

    rows: dict[Any, list[dict]] = {}
    for line in (src / "samples.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        rows.setdefault(rec["id"], []).append(rec)
    return {key: sorted(chains, key=lambda r: r["chain"]) for key, chains in rows.items()}


def chain_tensors(chains: list[dict], dim: int) -> tuple[Tensor, Tensor]:
    """``(rewards [C, m, D], mask [C, m])`` of sample rows; an unparsed candidate (None) is a zero row, absent."""
    rewards = torch.tensor([[r if r is not None else [0.0] * dim for r in c["rewards"]] for c in chains])
    mask = torch.tensor([[r is not None for r in c["rewards"]] for c in chains])
    return rewards, mask


def pools_from_samples(src: Path, report: dict[str, Any], chains: int, tokenizer: Any) -> list[PromptPool]:
    """The first ``chains`` chains of each prompt of an earlier evaluation (its ``samples.jsonl``, sampling order);
    a chain's tokens are its text re-tokenised plus EOS (the file keeps no ids)."""
    from vpo_lightning.training.records import read_records

    records = {r.get("id"): r for r in read_records(report["data_file"])}
    rows = read_samples(src)
    dim = len(report["dim_names"])
    pools = []
    for prompt in report["prompts"]:
        chain_rows = rows[prompt["id"]][:chains]
        rewards, mask = chain_tensors(chain_rows, dim)
        texts = [c["text"] for c in chain_rows]
        tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
        dims = prompt.get("real_dims")
        pools.append(PromptPool(records[prompt["id"]], rewards, mask, texts, tokens, 0,
                                None if dims is None else torch.tensor(dims, dtype=torch.bool)))
    return pools


def run_from_samples(args: argparse.Namespace) -> Path:
    """``--from_samples``: the metrics of the first ``--n`` solutions of an earlier evaluation, nothing sampled."""
    import json

    from vpo_lightning.generation.models import load_tokenizer

    src = Path(args.from_samples)
    if not (src / "eval.json").is_file() or not (src / "samples.jsonl").is_file():
        raise ValueError(f"--from_samples {src}: not a `vpo eval` output directory (needs eval.json and samples.jsonl)")
    report = json.loads((src / "eval.json").read_text(encoding="utf-8"))
    m = int(report["m"])
    _check_args(args, m)
    if args.n > report["n"]:
        raise ValueError(f"--n {args.n} is more than the {report['n']} solutions per prompt of {src}")
    t0 = time.perf_counter()
    pools = pools_from_samples(src, report, args.n // m, load_tokenizer(report["model"]))
    per_prompt = [prompt_metrics(p, report["seed"], args.orders, report.get("f_weights")) for p in pools]
    report.update({
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "n": args.n,
        "chains_per_prompt": args.n // m, "best_at_k_orders": args.orders, "subsampled_from": str(src),
        "label": args.label or report["label"], "prompts": per_prompt,
        "aggregate": aggregate_metrics(pools, per_prompt, report["dim_names"], report["seed"]),
    })
    report["aggregate"]["time_s"] = round(time.perf_counter() - t0, 2)  # recomputing only: nothing sampled
    out = Path(args.out) if args.out else src.parent / f"{src.name}-n{args.n}"
    check_out_dir(out, args.overwrite)
    write_outputs(out, report, pools)
    return out


def run(args: argparse.Namespace) -> Path:
    """Evaluate as ``args`` says; returns the output directory."""
    from vpo_lightning.generation.models import load_tokenizer

    if args.from_samples:
        return run_from_samples(args)
    t0 = time.perf_counter()
    config = find_config(args.config, args.ckpt, args.adapter)
    out = Path(args.out) if args.out else default_out_dir(args, config)
    check_out_dir(out, args.overwrite)  # before any sampling
    cfg = load_config(config, args.overrides, require=("rollout",))
    parsed = run_config(cfg, str(config), args.estimator)  # as `vpo fit` parses it
    sampler = eval_sampler(parsed)
    _check_args(args, sampler.protocol.m)
    prompts_file(parsed.parsed, args)  # a missing prompts file is told before the model loads
    device = pick_device(args.device)
    model, settings, info = load_model(cfg, device, ckpt=args.ckpt, adapter=args.adapter)
    tokenizer = load_tokenizer(settings.name)
    data_file, limit, records = load_prompts(parsed.parsed, args, tokenizer)
    ns = SimpleNamespace(policy=model, tokenizer=tokenizer, device=device, model_settings=settings)
    pools = sample_pools(ns, sampler, records, args.n // sampler.protocol.m, args.seed, args.prompts_per_call)
    context = {"config": config, "settings": settings, "info": info, "data_file": data_file, "limit": limit,
               "device": str(device)}
    report = build_report(args, cfg, context, sampler, pools)
    report["aggregate"]["time_s"] = round(time.perf_counter() - t0, 2)
    write_outputs(out, report, pools)
    if args.adapter or args.ckpt:  # the adapter's model card shows its newest evaluation
        refresh_card(args.adapter or Path(args.ckpt).parent / "adapters" / Path(args.ckpt).stem)
    return out


def summary(report: dict[str, Any]) -> str:
    """The one-line result of ``vpo eval``."""
    agg, n = report["aggregate"], report["n"]
    return (f"{report['label']}: best@1 {agg['best_at_k'][0]:.3f}  best@{n} {agg['best_at_k'][-1]:.3f}  "
            f"pass@{n} {agg['pass_at_k'][-1]:.3f}  diversity {agg['pairwise_l1_diversity']:.3f}  "
            f"E_w best {agg['expected_best_weighted']:.3f}  ({report['num_prompts']} prompts, {agg['time_s']:.0f}s)")


def main(argv: list[str]) -> int:
    """Entry point of ``vpo eval``."""
    return run_command("vpo eval", parse_args(build_parser(), argv), run, "eval.json", summary)

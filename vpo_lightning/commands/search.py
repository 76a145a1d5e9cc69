"""``vpo search``: test-time search with the task's reward functions as the verifier, under a fixed candidate budget.

    vpo search --config configs/code.yaml --budget 16                          # best-of-16, base model
    vpo search --config configs/code.yaml --adapter checkpoints/code-vpo/adapters/last --mode rejection
    vpo search --config configs/tooluse.yaml --budget 12 --max_prompts 20 --out checkpoints/search-tooluse

Modes:

* ``best_of_k``: sample ``--budget`` candidates per problem, score them all, keep the best (the first that solves,
  else the highest mean reward).
* ``rejection``: sample ``--chains_per_round`` chains per unsolved problem per round, in order, and stop at the first
  candidate whose reward vector is all >= 1 (solved), or when the budget is spent.

The budget counts individual solutions, as ``vpo eval`` does: a chain method (``vpo``, ``multi_rlvr``, decided by
the config's ``rollout.estimator`` or ``--estimator``) writes m candidates per generation, so a budget of 16 is
ceil(16 / m) chains of which only the first 16 candidates count (a missing or unparsable candidate uses its slot);
single-answer methods write one candidate per generation. The verifier is the config's ``rollout.rewards``
(:class:`vpo_lightning.rewards.RewardVector`); "solved" means every dimension is >= 1 (``metrics.solved``).

Output ``<out>/search.json``: per problem the solved flag, the best reward vector, the candidates used (rejection:
up to and including the first solver; best-of-k: the whole budget), where the first solver was, and the best
candidate's text; overall the solved fraction, ``solved_by_k`` (fraction of problems solved within the first k
candidates, k = 1..budget) and the generated tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from vpo_lightning.app import parse_args, run_command
from vpo_lightning.commands.runs import add_run_args
from vpo_lightning.training.config import get

log = logging.getLogger(__name__)

FORMAT = "vpo-search/1"
MODES = ("best_of_k", "rejection")


def build_parser() -> argparse.ArgumentParser:
    """The ``vpo search`` argument parser."""
    p = argparse.ArgumentParser(prog="vpo search", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_run_args(p)
    p.add_argument("--budget", type=int, default=16, help="candidate solutions per problem (chains: m per chain)")
    p.add_argument("--mode", choices=MODES, default="best_of_k", help="best_of_k, or rejection (stop at first solve)")
    p.add_argument("--split", choices=("test", "val", "train"), default="test", help="which split of the config's data")
    p.add_argument("--data_file", help="JSONL prompts to search on (overrides --split)")
    p.add_argument("--max_prompts", type=int, default=0, help="problems to search (a seeded sample; 0 = all, in order)")
    p.add_argument("--max_prompt_tokens", type=int, default=None,
                   help="skip longer prompts (default: the config's data.max_prompt_tokens; 0 = keep all)")
    p.add_argument("--chains_per_round", type=int, default=1, help="rejection: chains per unsolved problem per round")
    p.add_argument("--prompts_per_call", type=int, default=4, help="problems batched into one generate call")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--prompt_seed", type=int, default=0, help="seed of the problem sample (with --max_prompts)")
    p.add_argument("--estimator", help="override rollout.estimator (decides chain vs single-answer prompting)")
    p.add_argument("--label", help="name of this run (default: from the run name and weights)")
    p.add_argument("--out", help="output directory (default: beside the weights, else checkpoints/search-<config>)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    return p


@dataclass
class ProblemState:
    """The candidates drawn so far for one problem, in sampling order (chain by chain, answer by answer)."""

    record: dict
    rewards: list[list[float]] = field(default_factory=list)  # one D-vector per candidate slot (zeros when absent)
    present: list[bool] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    chains: int = 0
    tokens: int = 0
    first_solved: int | None = None  # 0-based slot of the first candidate that solves

    @property
    def done(self) -> bool:
        return self.first_solved is not None

    def add(self, rewards: torch.Tensor, present: torch.Tensor, texts: list[str | None]) -> None:
        for vec, ok, text in zip(rewards.tolist(), present.tolist(), texts):
            if ok and self.first_solved is None and all(v >= 1.0 for v in vec):
                self.first_solved = len(self.rewards)
            self.rewards.append([round(float(v), 6) for v in vec])
            self.present.append(bool(ok))
            self.texts.append(text if ok else None)


def chains_for(budget: int, m: int) -> int:
    """Generations needed for ``budget`` candidate solutions when each generation writes ``m``."""
    return math.ceil(budget / m)


def search_problems(ns: Any, sampler: Any, records: list[dict], budget: int, mode: str, seed: int,
                    prompts_per_call: int = 4, chains_per_round: int = 1) -> list[ProblemState]:
    """Run the search on ``records`` with ``sampler``'s engine and its chain protocol's prompts, parser and rewards.

    Args:
        ns: what the engine needs (``policy``, ``tokenizer``, ``device``, ``model_settings``).
        sampler: a :class:`vpo_lightning.training.sampler.Sampler` (chain protocol, engine, sampling settings).
        records: the problems.
        budget: candidate solutions per problem.
        mode: ``best_of_k`` or ``rejection``.
        seed: sampling seed (each engine call is seeded from it, the round and the call index).
        prompts_per_call: problems per generate call.
        chains_per_round: rejection only: chains per unsolved problem per round.

    Returns:
        One :class:`ProblemState` per record, in order.
    """
    protocol = sampler.protocol
    m, total = protocol.m, chains_for(budget, protocol.m)
    states = [ProblemState(r) for r in records]
    step = total if mode == "best_of_k" else max(1, chains_per_round)
    call, rnd = 0, 0
    while True:
        active = [s for s in states if s.chains < total and not (mode == "rejection" and s.done)]
        if not active:
            return states
        chains = min(step, total - active[0].chains)  # all active problems advance in lockstep
        for start in range(0, len(active), prompts_per_call):
            batch = active[start : start + prompts_per_call]
            gen = sampler.generate_chains(ns, [s.record for s in batch], chains, seed, "search", rnd, call)
            call += 1
            cands: list[list[str | None]] = []
            for i, text in enumerate(gen.texts):
                state = batch[i // chains]
                first_slot = (state.chains + i % chains) * m  # slot of this chain's first candidate
                parsed = protocol.candidates(text)
                cands.append([c if first_slot + j < budget else None for j, c in enumerate(parsed)])
            samples = [s.record for s in batch for _ in range(chains)]
            scores = protocol.score(cands, samples)
            for b, state in enumerate(batch):
                for c in range(b * chains, (b + 1) * chains):
                    keep = min(m, budget - (state.chains * m))
                    vecs = scores.rewards[c, :keep]  # [keep, D]
                    if scores.dim_mask is not None:  # per-record D (code): only the record's real dimensions
                        vecs = vecs[:, scores.dim_mask[c]]
                    state.add(vecs, scores.mask[c, :keep], cands[c][:keep])
                    state.tokens += len(gen.completion_ids[c])
                    state.chains += 1
        rnd += 1
        solved = sum(s.done for s in states)
        print(f"search: round {rnd}: {solved}/{len(states)} solved, "
              f"{sum(len(s.rewards) for s in states)} candidates so far", flush=True)


def problem_report(state: ProblemState, mode: str, budget: int) -> dict[str, Any]:
    """The search.json entry of one problem."""
    n = len(state.rewards)
    means = [sum(v) / len(v) if ok and v else -1.0 for v, ok in zip(state.rewards, state.present)]
    if state.first_solved is not None:
        best = state.first_solved
    elif any(state.present):
        best = max(range(n), key=lambda i: (means[i], -i))
    else:
        best = None
    used = state.first_solved + 1 if mode == "rejection" and state.first_solved is not None else n
    solved_slots = [i for i in range(n) if state.present[i] and all(v >= 1.0 for v in state.rewards[i])]
    dims = len(state.rewards[0]) if state.rewards else 0
    return {
        "id": state.record.get("id"), "solved": state.first_solved is not None,
        "best_reward": state.rewards[best] if best is not None else [0.0] * dims,
        "best_score": round(means[best], 6) if best is not None else 0.0,
        "candidates_used": used, "candidates_generated": n, "chains": state.chains, "budget": budget,
        "first_solved_at": None if state.first_solved is None else state.first_solved + 1,
        "num_solved": len(solved_slots), "num_present": sum(state.present), "generated_tokens": state.tokens,
        "best_candidate": state.texts[best] if best is not None else None,
    }


def aggregate(problems: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Overall numbers: solved fraction, solved within the first k candidates, candidates and tokens spent."""
    P = max(1, len(problems))
    firsts = [p["first_solved_at"] for p in problems]
    return {
        "solved_fraction": sum(p["solved"] for p in problems) / P,
        "num_solved": sum(p["solved"] for p in problems),
        "solved_by_k": [round(sum(f is not None and f <= k for f in firsts) / P, 6) for k in range(1, budget + 1)],
        "mean_candidates_used": sum(p["candidates_used"] for p in problems) / P,
        "mean_best_score": sum(p["best_score"] for p in problems) / P,
        "generated_tokens": sum(p["generated_tokens"] for p in problems),
    }


def load_records(cfg: Any, args: argparse.Namespace, tokenizer: Any) -> tuple[str, list[dict]]:
    """``(data file, records)``: the split's problems under the prompt-length limit; a seeded sample with
    ``--max_prompts``, else all of them in file order."""
    from vpo_lightning.commands.evaluate import prompts_file, select_prompts
    from vpo_lightning.generation.models import prompt_token_ids
    from vpo_lightning.training.records import read_records, template_tools

    data_file = prompts_file(cfg, args, "vpo search")
    limit = args.max_prompt_tokens
    if limit is None:
        limit = int(get(cfg, "data.max_prompt_tokens") or 0)  # cfg: the parsed config, defaults filled in
    records = read_records(data_file)
    if args.max_prompts:
        return data_file, select_prompts(records, tokenizer, args.max_prompts, limit, args.prompt_seed)
    kept = [r for r in records
            if not limit or len(prompt_token_ids(tokenizer, r["messages"], template_tools(r))) <= limit]
    if not kept:
        raise ValueError(f"no prompt of {data_file} has at most {limit} tokens: raise --max_prompt_tokens")
    return data_file, kept


def default_out_dir(args: argparse.Namespace, config: Path) -> Path:
    weights = args.ckpt or args.adapter
    if weights:
        return Path(weights).parent / f"search-{Path(weights).stem if args.ckpt else Path(weights).name}-{args.mode}"
    return Path("checkpoints") / f"search-{config.stem}-{args.mode}"


def run(args: argparse.Namespace) -> Path:
    """Search as ``args`` says; returns the output directory (holding search.json)."""
    from vpo_lightning.commands import evaluate, runs
    from vpo_lightning.generation.models import load_tokenizer

    if args.budget < 1 or args.prompts_per_call < 1 or args.chains_per_round < 1 or args.max_prompts < 0:
        raise ValueError("--budget, --prompts_per_call and --chains_per_round must be >= 1 (--max_prompts >= 0)")
    t0 = time.perf_counter()
    config = runs.find_config(args.config, args.ckpt, args.adapter)
    cfg = runs.load_config(config, args.overrides, require=("rollout",))
    parsed = runs.run_config(cfg, str(config), args.estimator)  # as `vpo fit` parses it
    sampler = evaluate.eval_sampler(parsed)
    protocol = sampler.protocol
    device = runs.pick_device(args.device)
    model, settings, info = runs.load_model(cfg, device, ckpt=args.ckpt, adapter=args.adapter)
    tokenizer = load_tokenizer(settings.name)
    data_file, records = load_records(parsed.parsed, args, tokenizer)
    ns = SimpleNamespace(policy=model, tokenizer=tokenizer, device=device, model_settings=settings)
    states = search_problems(ns, sampler, records, args.budget, args.mode, args.seed, args.prompts_per_call,
                             args.chains_per_round)
    problems = [problem_report(s, args.mode, args.budget) for s in states]
    report = {
        "format": FORMAT, "label": evaluate.default_label(cfg, args, settings.name),
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "mode": args.mode, "budget": args.budget, "config": str(config), "overrides": args.overrides,
        "run_name": cfg.get("run_name"), "model": settings.name, **info,
        "estimator": protocol.estimator, "m": protocol.m, "chains_per_problem": chains_for(args.budget, protocol.m),
        "chains_per_round": args.chains_per_round if args.mode == "rejection" else None,
        "tag_family": protocol.tag_family, "sampling": asdict(sampler.sampling), "rewards": protocol.reward_names,
        "dim_names": protocol.dim_names, "seed": args.seed, "split": args.split, "data_file": data_file,
        "num_prompts": len(problems), "device": str(device),
        "aggregate": {**aggregate(problems, args.budget), "time_s": round(time.perf_counter() - t0, 2)},
        "problems": problems,
    }
    out = Path(args.out) if args.out else default_out_dir(args, config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "search.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return out


def summary(report: dict[str, Any]) -> str:
    """The one-line result of ``vpo search``."""
    agg = report["aggregate"]
    return (f"{report['label']}: {report['mode']} budget {report['budget']} (m = {report['m']}): solved "
            f"{agg['num_solved']}/{report['num_prompts']} ({agg['solved_fraction']:.3f}), "
            f"{agg['mean_candidates_used']:.1f} candidates used on average, {agg['time_s']:.0f}s")


def main(argv: list[str]) -> int:
    """Entry point of ``vpo search``."""
    return run_command("vpo search", parse_args(build_parser(), argv), run, "search.json", summary)

"""OpenEvolve over `vpo serve` on the hardest HumanEval test problems: base model vs GRPO vs VPO adapters.

    bash benchmarks/setup_openevolve.sh                          # openevolve==0.4.1 into .venv
    .venv/bin/python benchmarks/openevolve_code.py --iterations 20 --problems 8 \\
        --grpo-adapter checkpoints/code-grpo/adapters/last --vpo-adapter checkpoints/code-vpo/adapters/last
    .venv/bin/python benchmarks/openevolve_code.py --model tiny-llama --iterations 2 --problem-ids HumanEval/1

For each model (the base model, then each adapter given), ``vpo serve`` is started as a subprocess on 127.0.0.1
(a free port) and OpenEvolve (pinned, full-rewrite mode, one island, ``--iterations`` LLM calls per problem, the
same seed) evolves each selected problem from the same starting program: the problem's signature and docstring
with a ``raise NotImplementedError`` body. The evaluator is the code task's own verifier
(:func:`vpo_lightning.tasks.code.run_tests`, sandboxed): fitness = fraction of the problem's hidden tests passed,
and the prompt feedback says how many pass and which (by number) fail, never their source. A problem counts as
solved when a program passes all of its tests; a run stops early once one does.

Problem selection (``--problems N``): the HumanEval test problems the base model fails most under best-of-k:
each problem of the test split (or the first ``--pool`` of them) gets ``--select-k`` single-answer samples from the
base model through the same server, scored with the ``code_tests`` reward; problems are ranked by how many samples
solve them (fewest first), ties broken by the best partial score (highest first: never solved, but closest, so
there is something to climb). ``--search-json`` ranks by a ``vpo search`` result instead, and ``--problem-ids``
skips selection. Adapters that do not exist are skipped and noted in the report.

Outputs: ``--out`` (default docs/openevolve_results.md), a markdown table of what each model solves, and
``<work-dir>/results.json`` with every run's details (OpenEvolve's output directories are kept under --work-dir).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OPENEVOLVE_VERSION = "0.4.1"
SYSTEM_MESSAGE = (
    "You are an expert Python programmer. The program is a Python function whose docstring specifies its "
    "behaviour; hidden unit tests check it. Rewrite the program so that it is correct. Keep the function name "
    "and signature, use only the standard library, and answer with the complete program in one ```python code "
    "block."
)
EVALUATOR = '''"""OpenEvolve evaluator for {task_id}: vpo_lightning's sandboxed per-test check (tests stay hidden)."""
import json

from openevolve.evaluation_result import EvaluationResult

from vpo_lightning.tasks.code import run_tests

with open({gt_path!r}, encoding="utf-8") as fh:
    GROUND_TRUTH = json.load(fh)


def evaluate(program_path):
    with open(program_path, encoding="utf-8") as fh:
        code = fh.read()
    passed = run_tests(code, GROUND_TRUTH)
    failing = [i + 1 for i, ok in enumerate(passed) if not ok]
    feedback = f"{{sum(passed)}}/{{len(passed)}} hidden tests pass"
    if failing:
        feedback += f"; failing tests (by number): {{failing}}"
    metrics = {{"combined_score": sum(passed) / len(passed), "tests_passed": float(sum(passed)),
               "solved": float(all(passed))}}
    return EvaluationResult(metrics=metrics, artifacts={{"tests": feedback}})
'''


# ---- configuration ----------------------------------------------------------------------------------------------
def code_config(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    """The `vpo fit` config the server loads: --config, else configs/code.yaml, else one derived from
    configs/tooluse.yaml for the code task; ``--model`` replaces its model name."""
    import yaml

    if args.config:
        path = Path(args.config)
    elif (REPO / "configs/code.yaml").is_file():
        path = REPO / "configs/code.yaml"
    else:
        path = REPO / "configs/tooluse.yaml"
    cfg = yaml.safe_load(path.read_text())
    if path.name == "tooluse.yaml":  # no code config in this checkout: the code task with the same model
        cfg["run_name"] = "openevolve-code"
        cfg["data"].update(train_files=[str(REPO / "data/code/train.jsonl")],
                           val_files=[str(REPO / "data/code/val.jsonl")], max_prompt_tokens=0)
        cfg["rollout"].update(rewards=["code_tests"], estimator="grpo", tag_family="fence")
        cfg["rollout"]["sampling"]["max_new_tokens"] = 384
    if args.model:
        cfg["model"]["model"]["name"] = args.model
        if args.model == "tiny-llama":
            cfg["model"]["model"]["dtype"] = "fp32"
    work.mkdir(parents=True, exist_ok=True)
    out = work / "serve_config.yaml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    source = os.path.relpath(path, REPO) if path.is_relative_to(REPO) else str(path)
    if path.name == "tooluse.yaml" and not args.config:
        source += " turned into the code task"
    return out, source + (f" with model {args.model}" if args.model else "")


# ---- the server subprocess --------------------------------------------------------------------------------------
class ServeProcess:
    """``vpo serve`` on 127.0.0.1 and a free port, as a subprocess; its log goes to ``log_path``."""

    def __init__(self, config: Path, adapter: str | None, adapter_name: str, log_path: Path, max_tokens: int,
                 startup_timeout: float = 900.0, extra: list[str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "vpo_lightning", "serve", "--config", str(config), "--host",
                    "127.0.0.1", "--port", "0", "--max-tokens-limit", str(max(max_tokens, 64)),
                    "--max-concurrency", "16", "--max-n", "16", "--request-timeout", "3600", *(extra or [])]
        if adapter:
            self.cmd += ["--adapter", adapter, "--adapter-name", adapter_name]
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.models: list[str] = []

    def __enter__(self) -> ServeProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        pattern = re.compile(r"vpo serve: serving (.+) at (http://\S+/v1)")
        while time.monotonic() < deadline:
            match = pattern.search(self.log_path.read_text(errors="replace"))
            if match:
                self.models, self.url = [m.strip() for m in match.group(1).split(",")], match.group(2)
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"vpo serve exited with {self.proc.returncode}; log:\n"
                                   f"{self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise TimeoutError(f"vpo serve did not start within {self.startup_timeout:.0f}s (log: {self.log_path})")

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/stats", timeout=30) as resp:
            return json.loads(resp.read())

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- problem selection ------------------------------------------------------------------------------------------
def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def best_of_k(records: list[dict], url: str, model: str, k: int, max_tokens: int, temperature: float,
              workers: int = 4) -> list[dict[str, Any]]:
    """For each record: k single-answer samples from the server, scored with the code_tests reward."""
    from openai import OpenAI

    from vpo_lightning.rewards import RewardVector

    client = OpenAI(base_url=url, api_key="unused", timeout=3600, max_retries=3)
    verifier = RewardVector(["code_tests"], max_workers=2)

    def one(record: dict) -> dict[str, Any]:
        r = client.chat.completions.create(model=model, messages=record["messages"], n=k, max_tokens=max_tokens,
                                           temperature=temperature, seed=0)
        texts = [c.message.content or "" for c in r.choices]
        scores = verifier.score([[t if t.strip() else None] for t in texts], [record] * len(texts))
        vecs = scores.rewards[:, 0]  # [k, D]
        return {"id": record["id"], "k": k, "num_solved": int((vecs >= 1).all(-1).sum()),
                "best_score": round(float(vecs.mean(-1).max()), 4)}

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, records))


def rank_hardest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fewest solving samples first; among those, the highest best partial score first; then file order."""
    return sorted(rows, key=lambda r: (r["num_solved"], -r["best_score"]))


def from_search_json(path: Path) -> list[dict[str, Any]]:
    report = json.loads(path.read_text())
    return [{"id": p["id"], "k": report["budget"], "num_solved": p["num_solved"], "best_score": p["best_score"]}
            for p in report["problems"]]


# ---- one OpenEvolve run -----------------------------------------------------------------------------------------
def initial_program(record: dict[str, Any]) -> str:
    """The starting program: the problem's imports, signature and docstring, with a stub body."""
    prompt = record["ground_truth"]["prompt"].rstrip() + "\n    raise NotImplementedError\n"
    return f"# EVOLVE-BLOCK-START\n{prompt}# EVOLVE-BLOCK-END\n"


def openevolve_config(url: str, model: str, iterations: int, max_tokens: int, temperature: float, seed: int,
                      timeout: int, workers: int = 1) -> Any:
    from openevolve.config import Config

    return Config.from_dict({
        "max_iterations": iterations, "checkpoint_interval": 10_000, "log_level": "WARNING", "random_seed": seed,
        "language": "python", "diff_based_evolution": False, "max_code_length": 20_000,
        "llm": {"api_base": url, "api_key": "unused", "models": [{"name": model, "weight": 1.0}],
                "temperature": temperature, "top_p": 1.0, "max_tokens": max_tokens, "timeout": timeout,
                "retries": 2, "retry_delay": 2, "random_seed": seed},
        "prompt": {"system_message": SYSTEM_MESSAGE, "num_top_programs": 2, "num_diverse_programs": 1,
                   "use_template_stochasticity": False, "include_artifacts": True},
        "database": {"in_memory": True, "log_prompts": False, "population_size": 100, "archive_size": 20,
                     "num_islands": 1, "random_seed": seed},
        "evaluator": {"timeout": 120, "max_retries": 1, "cascade_evaluation": False,
                      # OpenEvolve's worker processes: iterations in flight at once (the server batches them)
                      "parallel_evaluations": workers},
        # every child program with its score (and failed iterations), for auditing: <output>/evolution_trace.jsonl
        "evolution_trace": {"enabled": True, "include_code": True, "include_prompts": False, "include_failures": True,
                            "buffer_size": 1},
    })


def evolve_problem(record: dict[str, Any], url: str, model: str, work: Path, iterations: int, max_tokens: int = 512,
                   temperature: float = 1.0, seed: int = 0, timeout: int = 3600, workers: int = 1) -> dict[str, Any]:
    """Run OpenEvolve on one problem against an OpenAI-compatible ``url``; returns what it found."""
    from openevolve.api import run_evolution

    work.mkdir(parents=True, exist_ok=True)
    (work / "ground_truth.json").write_text(json.dumps(record["ground_truth"]))
    (work / "initial_program.py").write_text(initial_program(record))
    (work / "evaluator.py").write_text(EVALUATOR.format(task_id=record["id"],
                                                        gt_path=str((work / "ground_truth.json").resolve())))
    config = openevolve_config(url, model, iterations, max_tokens, temperature, seed, timeout, workers)
    t0 = time.perf_counter()
    result = run_evolution(str(work / "initial_program.py"), str(work / "evaluator.py"), config=config,
                           iterations=iterations, output_dir=str(work / "openevolve"), cleanup=False,
                           target_score=1.0)
    metrics = dict(result.metrics or {})
    best = result.best_program
    (work / "best_program.py").write_text(result.best_code or "")
    trace = work / "openevolve" / "evolution_trace.jsonl"
    children = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()] if trace.is_file() else []
    return {
        "id": record["id"], "model": model, "solved": metrics.get("solved", 0.0) >= 1.0,
        "best_score": round(float(metrics.get("combined_score", 0.0)), 4),
        "tests_passed": int(metrics.get("tests_passed", 0)), "num_tests": len(record["ground_truth"]["tests"]),
        "iteration_found": getattr(best, "iteration_found", None), "iterations": iterations,
        "traced_iterations": len(children),
        "time_s": round(time.perf_counter() - t0, 1), "output_dir": str(work / "openevolve"),
    }


# ---- report -----------------------------------------------------------------------------------------------------
def _cell(run: dict[str, Any] | None) -> str:
    if run is None:
        return "-"
    if run.get("error"):
        return "error"
    mark = "**solved**" if run["solved"] else "no"
    where = f", iter {run['iteration_found']}" if run["solved"] and run.get("iteration_found") is not None else ""
    return f"{mark} ({run['tests_passed']}/{run['num_tests']} tests{where})"


def write_markdown(path: Path, results: dict[str, Any]) -> None:
    s, models = results["settings"], results["models"]
    ran = [m for m in models if not m.get("skipped")]
    problems = results["problems"]
    lines = [
        "# OpenEvolve on the hardest HumanEval test problems",
        "",
        f"Generated by `benchmarks/openevolve_code.py` on {results['timestamp']} ({results['machine']}).",
        "",
        f"OpenEvolve {s['openevolve']} (full rewrites, 1 island, seed {s['seed']}) drove each model through "
        f"`vpo serve` (transformers engine, 127.0.0.1) for **{s['iterations']} iterations per problem** "
        f"(one LLM call each, max_tokens {s['max_tokens']}, temperature {s['temperature']}, "
        f"{s.get('workers', 1)} OpenEvolve worker(s)), starting from the "
        "problem's signature and docstring with a stub body. Fitness is the fraction of the problem's hidden tests "
        "passed (the code task's sandboxed verifier); a run stops once a program passes all of them. "
        f"Base model: `{s['base_model']}` (config `{s['config']}`)."
        + (f" Server flags: `{' '.join(s['serve_args'])}`." if s.get("serve_args") else ""),
        "",
        f"Problems: {s['selection']}",
        "",
        "| problem | base best-of-k (solved/k, best score) | " + " | ".join(m["label"] for m in ran) + " |",
        "|---|---|" + "---|" * len(ran),
    ]
    for p in problems:
        sel = p.get("selection")
        sel_text = f"{sel['num_solved']}/{sel['k']}, {sel['best_score']:.2f}" if sel else "-"
        cells = [_cell(m["runs"].get(p["id"])) for m in ran]
        lines.append(f"| {p['id']} | {sel_text} | " + " | ".join(cells) + " |")
    solved = [str(sum(bool(r.get("solved")) for r in m["runs"].values())) + f"/{len(problems)}" for m in ran]
    lines.append("| **solved** | | " + " | ".join(f"**{x}**" for x in solved) + " |")
    lines += ["", "| model | weights | LLM requests | generate calls | generated tokens | tokens per wall s | "
              "OpenEvolve wall time |", "|---|---|---|---|---|---|---|"]
    for m in ran:
        calls = m.get("generate_calls", "-")  # absent in results written before this column existed
        lines.append(f"| {m['label']} | `{m['adapter'] or 'base'}` | {m['requests']} | {calls} | "
                     f"{m['generated_tokens']} | {m['generated_tokens'] / max(m['time_s'], 1e-9):.1f} | "
                     f"{m['time_s']:.0f}s |")
    skipped = [m for m in models if m.get("skipped")]
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{m['label']} ({m['skipped']})" for m in skipped) + "."]
    lines += ["", f"Command: `{results['command']}`", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")


# ---- main -------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="`vpo fit` config of the code task (default: configs/code.yaml if present, "
                                    "else configs/tooluse.yaml turned into the code task)")
    p.add_argument("--model", help="override the config's model.model.name (e.g. tiny-llama for a smoke run)")
    p.add_argument("--grpo-adapter", help="PEFT adapter directory of the GRPO run")
    p.add_argument("--vpo-adapter", help="PEFT adapter directory of the VPO run")
    p.add_argument("--iterations", type=int, default=10, help="OpenEvolve iterations (LLM calls) per problem")
    p.add_argument("--workers", type=int, default=1,
                   help="OpenEvolve worker processes per problem: LLM calls in flight at once, batched by the "
                        "server (more tokens/s on CPU; the iteration budget is the same)")
    p.add_argument("--keep-seeds", dest="ignore_seed", action="store_false",
                   help="keep OpenEvolve's per-call seeds (then concurrent calls are not batched; by default the "
                        "server gets --ignore-seed when --workers > 1)")
    p.add_argument("--problems", type=int, default=4, help="how many of the hardest problems")
    p.add_argument("--problem-ids", help="comma-separated HumanEval ids (skips selection)")
    p.add_argument("--search-json", help="rank problems by this `vpo search` result instead of sampling")
    p.add_argument("--select-k", type=int, default=8, help="best-of-k samples per problem for the selection")
    p.add_argument("--pool", type=int, default=0, help="consider only the first N test problems (0 = all 64)")
    p.add_argument("--data-file", default=str(REPO / "data/code/test.jsonl"), help="the problems")
    p.add_argument("--max-tokens", type=int, default=512, help="max_tokens of each LLM call")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of each LLM call")
    p.add_argument("--seed", type=int, default=0, help="OpenEvolve and sampling seed")
    p.add_argument("--serve-arg", dest="serve_args", action="append", default=[], metavar="ARG",
                   help="extra `vpo serve` argument, repeatable, e.g. --serve-arg=--threads=1 "
                        "--serve-arg=--set=model.model.dtype=fp32 (faster on a busy CPU)")
    p.add_argument("--work-dir", default=str(REPO / "checkpoints/openevolve-code"), help="run outputs")
    p.add_argument("--out", default=str(REPO / "docs/openevolve_results.md"), help="markdown report")
    return p


def select(args: argparse.Namespace, records: list[dict], server: ServeProcess) -> tuple[list[dict], str]:
    """The problems to evolve, with their selection statistics, and a sentence saying how they were chosen."""
    by_id = {r["id"]: r for r in records}
    if args.problem_ids:
        ids = [i.strip() for i in args.problem_ids.split(",") if i.strip()]
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise SystemExit(f"--problem-ids not in {args.data_file}: {missing}")
        return [{"id": i, "record": by_id[i], "selection": None} for i in ids], "given by --problem-ids."
    if args.search_json:
        rows = [r for r in from_search_json(Path(args.search_json)) if r["id"] in by_id]
        how = f"ranked by `{args.search_json}`"
    else:
        pool = records[: args.pool] if args.pool else records
        print(f"selecting: best-of-{args.select_k} of the base model on {len(pool)} problems", flush=True)
        rows = best_of_k(pool, server.url, server.models[0], args.select_k, args.max_tokens, args.temperature)
        how = f"best-of-{args.select_k} single-answer samples of the base model on {len(pool)} test problems"
    picked = rank_hardest(rows)[: args.problems]
    text = (f"the {len(picked)} HumanEval test problems the base model fails most ({how}; fewest solving samples "
            "first, ties broken by the best partial score).")
    return [{"id": r["id"], "record": by_id[r["id"]], "selection": r} for r in picked], text


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        version = md.version("openevolve")
    except md.PackageNotFoundError:
        raise SystemExit("openevolve is not installed: bash benchmarks/setup_openevolve.sh") from None
    if version != OPENEVOLVE_VERSION:
        print(f"warning: openevolve {version} installed; this benchmark is pinned to {OPENEVOLVE_VERSION}")
    work = Path(args.work_dir)
    config, source = code_config(args, work)
    records = read_records(Path(args.data_file))
    wanted = [("base", None), ("GRPO", args.grpo_adapter), ("VPO", args.vpo_adapter)]
    # OpenEvolve sends a new seed with every LLM call; the server batches only equal seeds, so with several
    # workers in flight the seeds are dropped (otherwise every call is its own generate call)
    serve_args = args.serve_args + (["--ignore-seed"] if args.workers > 1 and args.ignore_seed else [])
    models: list[dict[str, Any]] = []
    problems: list[dict[str, Any]] = []
    selection = ""
    t_all = time.perf_counter()
    for label, adapter in wanted:
        entry: dict[str, Any] = {"label": label, "adapter": adapter, "runs": {}}
        models.append(entry)
        if label != "base" and not adapter:
            entry["skipped"] = "no adapter given"
            continue
        if adapter and not (Path(adapter) / "adapter_config.json").is_file():
            entry["skipped"] = f"adapter {adapter} not found"
            print(f"skipping {label}: {entry['skipped']}", flush=True)
            continue
        with ServeProcess(config, adapter, label.lower(), work / f"serve-{label.lower()}.log",
                          args.max_tokens, extra=serve_args) as server:
            model_id = server.models[-1]  # the adapter when there is one, else the base
            print(f"{label}: serving {model_id} at {server.url}", flush=True)
            if not problems:
                problems, selection = select(args, records, server)
                print("problems: " + ", ".join(p["id"] for p in problems), flush=True)
            before, t0 = server.stats(), time.perf_counter()  # selection (if any) is not counted
            for p in problems:
                run_dir = work / label.lower() / p["id"].replace("/", "_")
                try:
                    run = evolve_problem(p["record"], server.url, model_id, run_dir, args.iterations,
                                         args.max_tokens, args.temperature, args.seed,
                                         workers=args.workers)
                except Exception as err:  # noqa: BLE001 - one failed run is reported, the others go on
                    run = {"id": p["id"], "error": f"{type(err).__name__}: {err}", "solved": False}
                entry["runs"][p["id"]] = run
                print(f"{label} {p['id']}: {_cell(run)}", flush=True)
            after = server.stats()
        entry.update(requests=after["requests"] - before["requests"],
                     generate_calls=after["batches"] - before["batches"],
                     generated_tokens=after["generated_tokens"] - before["generated_tokens"],
                     time_s=time.perf_counter() - t0, model_id=model_id)
    results = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end",
        "command": "python benchmarks/openevolve_code.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {"openevolve": version, "iterations": args.iterations, "serve_args": serve_args,
                     "max_tokens": args.max_tokens, "workers": args.workers,
                     "temperature": args.temperature, "seed": args.seed, "config": source,
                     "base_model": _model_name(config), "selection": selection},
        "problems": [{"id": p["id"], "selection": p["selection"]} for p in problems],
        "models": models, "time_s": round(time.perf_counter() - t_all, 1),
    }
    (work / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(Path(args.out), results)
    print(f"wrote {args.out} and {work / 'results.json'} ({results['time_s']:.0f}s)")
    return 0


def _model_name(config: Path) -> str:
    import yaml

    return yaml.safe_load(config.read_text())["model"]["model"]["name"]


if __name__ == "__main__":
    sys.exit(main())

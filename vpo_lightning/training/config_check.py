"""Configuration errors that say what to change: unknown keys with the closest known ones, and machine checks.

jsonargparse rejects a misspelled key with ``unrecognized arguments`` (command line) or ``does not accept option``
(YAML), after a page of usage text. :func:`find_unknown_keys` finds the offending keys on the command line and in
every ``--config`` file and names the closest valid keys (``difflib``); ``VPOCLI.parse_arguments`` prints that
instead of the usage. :func:`preflight` checks options that need a package or hardware this machine may lack (a GPU
accelerator, flash-attention, vLLM) before anything heavy is loaded, and says what to install or what to change.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vpo_lightning.training.config import get, import_class, renamed_class_paths
from vpo_lightning.training.config_keys import RENAMED_KEYS, config_file_keys, is_known, known_keys, suggest

# TRL's GRPOConfig / script names -> ours, with what differs (docs/COMING_FROM_TRL.md has the whole table)
TRL_NAMES: dict[str, tuple[str, str]] = {
    "learning_rate": ("model.optim.lr", ""),
    "num_generations": ("rollout.group_size", "chains sampled per prompt"),
    "max_completion_length": ("rollout.sampling.max_new_tokens", ""),
    "per_device_train_batch_size": ("data.batch_size", "counts prompts here; a step trains on batch_size x "
                                    "group_size chains"),
    "gradient_accumulation_steps": ("data.batch_size", "a step's batch is data.batch_size prompts; "
                                    "model.optim.micro_batch_size bounds memory"),
    "beta": ("model.loss.beta", ""),
    "epsilon": ("model.loss.clip_low", ""),
    "epsilon_high": ("model.loss.clip_high", ""),
    "loss_type": ("model.loss.aggregation", ""),
    "temperature": ("rollout.sampling.temperature", ""),
    "top_p": ("rollout.sampling.top_p", ""),
    "top_k": ("rollout.sampling.top_k", ""),
    "max_prompt_length": ("data.max_prompt_tokens", ""),
    "num_iterations": ("model.optim.num_iterations", ""),
    "max_grad_norm": ("model.optim.max_grad_norm", ""),
    "weight_decay": ("model.optim.weight_decay", ""),
    "warmup_steps": ("model.optim.warmup_steps", ""),
    "num_train_epochs": ("trainer.max_epochs", ""),
    "logging_steps": ("trainer.log_every_n_steps", ""),
    "save_steps": ("checkpoint.every_n_train_steps", ""),
    "output_dir": ("run_name", "outputs go to checkpoints/<run_name>/"),
    "seed": ("seed_everything", "and rollout.seed for sampling"),
    "reward_funcs": ("rollout.rewards", "TRL reward functions work as dotted paths"),
    "reward_weights": ("rollout.rewards", "VPO samples the weights (rollout.num_weights); there are none to set"),
    "use_vllm": ("rollout.engine", "--rollout.engine=vpo_lightning.generation.engines.VLLMEngine"),
    "model_name_or_path": ("model.model.name", ""),
    "torch_dtype": ("model.model.dtype", "bf16, fp32, fp16 or auto"),
    "bf16": ("model.model.dtype", "--model.model.dtype=bf16"),
    "fp16": ("model.model.dtype", "--model.model.dtype=fp16"),
    "use_peft": ("model.model.lora.enabled", ""),
    "lora_r": ("model.model.lora.r", ""),
    "lora_alpha": ("model.model.lora.alpha", ""),
    "lora_dropout": ("model.model.lora.dropout", ""),
    "lora_target_modules": ("model.model.lora.target_modules", ""),
    "dataset_name": ("data.train_files", "a file, a save_to_disk folder or a Hub id"),
    "train_dataset": ("data.train_files", "a file, a save_to_disk folder or a Hub id"),
    "eval_dataset": ("data.val_files", ""),
    "report_to": ("trainer.logger", "TensorBoard under checkpoints/<run_name>/ by default; any Lightning logger "
                  "(e.g. lightning.pytorch.loggers.WandbLogger) as trainer.logger"),
    "warmup_ratio": ("model.optim.warmup_steps", "a number of steps: warmup_ratio x trainer.max_steps"),
    "lr_scheduler_type": ("model.optim.schedule", "constant (the default), linear or cosine, decaying to "
                          "model.optim.min_lr_ratio; the warm-up is model.optim.warmup_steps"),
    "eval_steps": ("trainer.val_check_interval", "validation every this many steps"),
    "eval_strategy": ("trainer.val_check_interval", "validation every this many steps; data.val_files empty: none"),
    "save_total_limit": ("checkpoint.keep_last", "the newest N step=<N>.ckpt files and their adapters are kept"),
    "scale_rewards": ("rollout.estimator", "the advantage scaling comes with the estimator (vpo and grpo: z-score "
                      "within the prompt group, TRL's scale_rewards='group'); it is not a separate switch"),
    "log_completions": ("rollout.log_samples_every", "a table of sample completions in TensorBoard every N steps; "
                        "rollout.save_completions=true writes every chain to completions/rank<r>.jsonl"),
    "num_completions_to_print": ("rollout.log_samples_every", "sample completions go to TensorBoard's text tab"),
}
# value spellings of torch/TRL -> ours, for the Literal dtype keys
VALUE_ALIASES = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float32": "fp32", "float": "fp32",
                 "torch.float32": "fp32", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class UnknownKey:
    """A key no parser option matches: where it was given and the closest known keys."""

    key: str
    where: str  # "the command line" or a config file path
    suggestions: tuple[str, ...] = ()
    note: str = ""  # e.g. TRL's name for the suggested key

    def message(self) -> str:
        hint = ""
        if self.suggestions:
            hint = " Did you mean " + " or ".join(repr(s) for s in self.suggestions) + "?"
        return f"unknown key {self.key!r} in {self.where}.{hint}{' ' + self.note if self.note else ''}"


def unknown_key(key: str, where: str, known: frozenset[str]) -> UnknownKey:
    last = key.rpartition(".")[2]
    if last in TRL_NAMES and TRL_NAMES[last][0] in known:
        ours, why = TRL_NAMES[last]
        return UnknownKey(key, where, (ours,), f"({last} is TRL's name{': ' + why if why else ''})")
    return UnknownKey(key, where, tuple(suggest(key, known)))


def command_line_keys(argv: Sequence[str]) -> list[str]:
    """Dotted keys given as ``--key value`` / ``--key=value`` / ``--key+ value`` options."""
    keys = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            keys.append(token[2:].split("=", 1)[0].rstrip("+"))
    return keys


def config_paths(argv: Sequence[str]) -> list[str]:
    """The files given with ``--config``/``-c``."""
    paths = []
    for i, token in enumerate(argv):
        if token in ("--config", "-c") and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif token.startswith("--config="):
            paths.append(token.split("=", 1)[1])
    return paths


def find_unknown_keys(parser: Any, argv: Sequence[str]) -> list[UnknownKey]:
    """Keys on the command line ``argv`` (after the subcommand) and in its ``--config`` files that ``parser`` (the
    subcommand's parser) does not know, each with the closest known keys. A renamed key (:data:`RENAMED_KEYS`) is
    known: the parser reads it as its new one."""
    import yaml

    leaves, sections = known_keys(parser)
    known = leaves | sections
    given = command_line_keys(argv)
    found = [unknown_key(k, "the command line", known) for k in given
             if k not in ("help", "config", *RENAMED_KEYS) and not is_known(k, leaves, sections)]
    for path in config_paths(argv):
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse reports unreadable files itself
        if isinstance(data, Mapping):
            found += [unknown_key(k, path, known) for k in config_file_keys(data, leaves, sections)
                      if k not in RENAMED_KEYS]
    return found


def _choices(parser: Any) -> dict[str, tuple[Any, ...]]:
    """The allowed values of every ``Literal``-typed key of ``parser``."""
    out = {}
    for action in getattr(parser, "_actions", []):
        hint = getattr(action, "_typehint", None)
        if getattr(hint, "__origin__", None) is Literal:
            out[action.dest] = hint.__args__
    return out


def _yaml_lines(path: str) -> dict[str, tuple[Any, int]]:
    """``dotted key -> (value, line)`` of the scalar values of a YAML file."""
    import yaml

    out: dict[str, tuple[Any, int]] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                walk(v, f"{prefix}{k.value}.")
        elif isinstance(node, yaml.ScalarNode):
            out[prefix[:-1]] = (yaml.safe_load(node.value) if node.style is None else node.value,
                                node.start_mark.line + 1)

    with contextlib.suppress(OSError, yaml.YAMLError):
        walk(yaml.compose(Path(path).read_text(encoding="utf-8")), "")
    return out


def find_bad_values(parser: Any, argv: Sequence[str]) -> list[str]:
    """Values of choice keys (``model.model.dtype`` ...) outside their choices, in ``--config`` files (with the
    line) and on the command line, each with the allowed values and the closest one (``bfloat16`` -> ``bf16``)."""
    choices = _choices(parser)
    given: list[tuple[str, Any, str]] = []
    for path in config_paths(argv):
        given += [(k, v, f"{path}, line {line}") for k, (v, line) in _yaml_lines(path).items()]
    for i, token in enumerate(argv):
        if token.startswith("--") and len(token) > 2:
            key, eq, value = token[2:].partition("=")
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            given.append((key, value, "the command line"))
    problems = []
    for key, value, where in given:
        allowed = choices.get(key)
        if allowed is None or value in allowed or str(value) in map(str, allowed):
            continue
        alias = VALUE_ALIASES.get(str(value).lower())
        hint = f" Did you mean {alias!r}?" if alias in allowed else ""
        problems.append(f"{where}: {key}: {value!r} is not one of {', '.join(map(repr, allowed))}.{hint}")
    return problems


def _yaml_loader() -> type:
    """A safe YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) or key is None:
                    line = key_node.start_mark.line + 1
                    if key in seen:
                        raise _DuplicateKey(key, seen[key], line)
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, line: int) -> None:
        super().__init__(f"key {key!r} is given twice (first on line {first})")
        self.key, self.first, self.line = key, first, line


def yaml_file_problem(path: str | Path) -> str | None:
    """One line naming ``path`` (and the line) when it is not a readable YAML file, else None.

    Catches what jsonargparse reports as ``in "<unicode string>", line 1``: syntax errors, tab indentation, a key
    given twice, a missing file or a directory.
    """
    import yaml

    path = Path(path)
    name = repr(str(path))
    if path.is_dir():
        return f"config file {name} is a directory; give a YAML file (e.g. configs/tooluse.yaml)"
    if not path.is_file():
        return f"config file {name} does not exist; check the path (the shipped configs are in configs/)"
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        return f"config file {name} is not UTF-8 text (byte {err.object[err.start]:#04x}); save it as UTF-8"
    except OSError as err:
        return f"config file {name} cannot be read: {err.strerror or err}"
    try:
        yaml.load(text, Loader=_yaml_loader())  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as err:
        return f"config file {name}, line {err.line}: {err}; keep one of them"
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"config file {name}, line {mark.line + 1}, column {mark.column + 1}" if mark else f"config file {name}"
        problem = err.problem or "invalid YAML"
        lines = text.splitlines()
        at = lines[mark.line][mark.column : mark.column + 1] if mark and mark.line < len(lines) else ""
        if at == "\t" or "'\\t'" in problem:
            return f"{where}: a tab character: YAML indents with spaces; replace the tab with spaces"
        context = ""
        if err.context and err.context_mark is not None and err.context_mark is not mark:
            context = f" ({err.context}, line {err.context_mark.line + 1}, column {err.context_mark.column + 1})"
        return f"{where}: {problem}{context}; fix the YAML syntax there"
    except yaml.YAMLError as err:
        return f"config file {name}: not valid YAML ({' '.join(str(err).split())})"
    return None


def moved_class_paths(argv: Sequence[str]) -> list[str]:
    """One line per class path in the ``--config`` files of ``argv`` that moved (:data:`RENAMED_CLASS_PATHS`),
    naming the new one: a run saved before the package's layers (its config.yaml) resumes once they are changed."""
    import yaml

    out = []
    for path in config_paths(argv):
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue  # reported by yaml_file_problem
        out += [f"{path}: class_path {old} moved: use {new} (a run saved before the move can be resumed by "
                "changing it in its config.yaml)" for old, new in renamed_class_paths(data)]
    return out


def explain_parse_error(message: str, subcommand_parser: Any | None, argv: Sequence[str], prog: str = "vpo",
                        subcommands: Sequence[str] = ()) -> str:
    """A short message for a failed parse: a config file that is not valid YAML (named, with the line), unknown
    keys with suggestions when there are any, else jsonargparse's own message; always ends with where to look for
    the valid keys."""
    lines: list[str] = []
    if argv and not argv[0].startswith("-") and subcommands and argv[0] not in subcommands:
        close = difflib.get_close_matches(argv[0], list(subcommands), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        lines.append(f"unknown command {argv[0]!r}.{hint} Commands: {', '.join(subcommands)}")
    elif bad_files := [p for p in map(yaml_file_problem, config_paths(argv)) if p]:
        lines += bad_files
    elif moved := moved_class_paths(argv):
        lines += moved
    elif subcommand_parser is not None:
        lines += [u.message() for u in find_unknown_keys(subcommand_parser, argv[1:])]
        lines += find_bad_values(subcommand_parser, argv[1:]) if not lines else []
    if not lines:
        lines.append(" ".join(message.split()))  # jsonargparse's message, on one line
    sub = argv[0] if argv and argv[0] in subcommands else "fit"
    lines.append(f"(every key, with its documentation: {prog} {sub} --help)")
    return "\n".join(f"{prog}: error: {line}" if i == 0 else f"  {line}" for i, line in enumerate(lines))


# --------------------------------------------------------------------------------------------- machine checks


def _engine_is_vllm(value: Any) -> bool:
    """Whether ``rollout.engine`` (a class_path string, ``{class_path, init_args}`` or an engine) is a VLLMEngine,
    by its class (a subclass counts; a name that merely contains "VLLM" does not)."""
    from vpo_lightning.generation.engines import VLLMEngine

    if value is None:
        return False
    path = value if isinstance(value, str) else get(value, "class_path")
    if path is None:
        return isinstance(value, VLLMEngine)
    try:
        cls = import_class(str(path))
    except ValueError:
        return False  # jsonargparse names the bad class_path itself
    return isinstance(cls, type) and issubclass(cls, VLLMEngine)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def vllm_budget_problems(cfg: Any) -> list[str]:
    """vLLM stops a chain at ``max_model_len`` without saying so: the prompt budget plus the generation budget must
    fit in it (checked before any model loads; ``VLLMEngine.setup`` checks again)."""
    engine = get(cfg, "rollout.engine")
    max_len = getattr(engine, "max_model_len", None) or get(engine, "init_args.max_model_len", 4096)
    prompt = int(get(cfg, "data.max_prompt_tokens", 0) or 0)
    new = int(get(cfg, "rollout.sampling.max_new_tokens", 256))
    if prompt + new <= int(max_len) and new < int(max_len):
        return []
    return [f"data.max_prompt_tokens ({prompt}) + rollout.sampling.max_new_tokens ({new}) = {prompt + new} tokens do "
            f"not fit in rollout.engine.init_args.max_model_len={max_len}: vLLM would stop chains early. Raise "
            f"--rollout.engine.init_args.max_model_len to at least {prompt + new} (within the model's context), or "
            "lower data.max_prompt_tokens or rollout.sampling.max_new_tokens."]


_PRECISION_DTYPES = {"bf16": "bf16", "16": "fp16", "32": "fp32", "64": "fp32", "transformer-engine": "bf16"}


def lightning_only_keys(cfg: Any) -> list[str]:
    """Trainer keys that ``vpo fit --help`` lists (Lightning's) but this project does not use, set to something
    else than their default: each with the project's own key for it. The policy updates itself (manual
    optimisation: Lightning's clipping and accumulation never run) and is loaded in one dtype."""
    problems = []
    precision = get(cfg, "trainer.precision")
    if precision is not None and str(precision) not in ("32", "32-true", "64", "64-true", "bf16-true", "16-true"):
        # mixed precision: Lightning's autocast does not reach the manual update and the rollout engine, which run
        # the policy in the one dtype it was loaded in. The "-true" precisions work (FSDP needs bf16-true); the
        # run warns at fit start that they cast the LoRA weights and RoPE (PolicyModule.on_fit_start).
        dtype = _PRECISION_DTYPES.get(str(precision).split("-")[0], "bf16")
        problems.append(f"trainer.precision={precision}: mixed precision is not supported here (the policy is loaded "
                        "in one dtype, which the rollout engine shares, and its LoRA weights train in fp32); set "
                        f"--model.model.dtype {dtype} instead and keep trainer.precision 32-true (auto: bf16 where "
                        "the hardware computes it, else fp32)")
    clip = get(cfg, "trainer.gradient_clip_val")
    if clip is not None or get(cfg, "trainer.gradient_clip_algorithm") is not None:
        shown = f" {clip}" if clip is not None else ""
        problems.append(f"trainer.gradient_clip_val / gradient_clip_algorithm: Lightning's clipping does not run "
                        f"here; the update clips the gradient norm itself: set --model.optim.max_grad_norm{shown} "
                        "(default 1.0, 0 = off)")
    accumulate = get(cfg, "trainer.accumulate_grad_batches")
    if accumulate not in (None, 1):
        problems.append(f"trainer.accumulate_grad_batches={accumulate}: a step already accumulates the gradient of "
                        "its whole batch over micro-batches; for a larger batch raise --data.batch_size (x"
                        f"{accumulate}), and bound memory with --model.optim.micro_batch_size")
    return problems


def preflight(cfg: Any) -> list[str]:
    """Problems with options that need a package or a GPU this machine lacks, or Lightning trainer keys this project
    does not use (:func:`lightning_only_keys`); each says what to do instead.

    Args:
        cfg: the parsed configuration of one subcommand (``trainer``, ``model``, ``rollout`` sections).
    """
    problems = lightning_only_keys(cfg)
    if get(cfg, "checkpoint.push_to_hub"):  # the upload comes at the end of training: check it can work now
        from vpo_lightning.generation.adapters import hub_push_problem

        if problem := hub_push_problem(get(cfg, "checkpoint.hub_model_id")):
            problems.append(f"checkpoint.push_to_hub: {problem}")
    accelerator = get(cfg, "trainer.accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda") and not _has_cuda():
        import torch

        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        problems.append(
            f"trainer.accelerator={accelerator} but torch sees no CUDA GPU here (torch {torch.__version__}, {build}). "
            "Set --trainer.accelerator=cpu (or auto), or run on a machine with a GPU and a CUDA build of torch."
        )
    if get(cfg, "model.model.attn_implementation") == "flash_attention_2":
        missing = importlib.util.find_spec("flash_attn") is None
        if missing or not _has_cuda():
            need = "the flash-attn package (pip install 'vpo-lightning[flash]')" if missing else "a CUDA GPU"
            problems.append(f"model.model.attn_implementation=flash_attention_2 needs {need}. "
                            "Set --model.model.attn_implementation=sdpa to run here.")
    if _engine_is_vllm(get(cfg, "rollout.engine")):
        problems += vllm_budget_problems(cfg)
        missing = importlib.util.find_spec("vllm") is None
        if missing or not _has_cuda():
            need = "vLLM (pip install 'vpo-lightning[vllm]')" if missing else "a CUDA GPU"
            problems.append(f"rollout.engine=VLLMEngine needs {need}. To run here, use "
                            "--rollout.engine=vpo_lightning.generation.engines.TransformersEngine.")
    return problems

"""SFT data: demonstrations tokenised as rollouts see them, a held-out part for the validation loss, and packing.

Tokenisation matches the rollout exactly: the prompt is :func:`vpo_lightning.generation.models.prompt_token_ids` of the
messages (chat template with the assistant generation prompt), the completion is the demonstration text followed
by the tokenizer's EOS (where generation stops). Only completion tokens carry loss.

Packing puts several examples in one row ``[prompt_1 | completion_1 | prompt_2 | completion_2 | ...]`` with a
block-diagonal causal mask (:func:`vpo_lightning.core.packing.packed_attention_mask` with no shared prompt: each
example attends only to itself) and position ids that restart at 0 for every example, so a packed row computes
the same log-probs as the examples one by one, without padding.

Batches come from :class:`vpo_lightning.training.datamodule.PromptStream` (a seeded order and a position saved in every
checkpoint), so ``--ckpt_path last`` resumes at the next unseen batch.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from vpo_lightning.core.packing import packed_attention_mask
from vpo_lightning.tasks.demos import demo_builders
from vpo_lightning.training.datamodule import StreamDataModule
from vpo_lightning.training.records import template_tools

# data.builder: a task's registered demonstration builder (tasks/<name>/demos.py), or none for ready demonstrations
BuilderName = Literal[(*demo_builders(), "none")]  # type: ignore[valid-type]

log = logging.getLogger(__name__)


def tokenize_example(tokenizer: Any, messages: list[dict[str, str]], completion: str,
                     tools: list[dict] | None = None) -> dict[str, list[int]]:
    """``{"prompt_ids", "completion_ids"}``: the rollout's prompt tokens (``tools`` to the chat template, as
    :func:`vpo_lightning.training.records.template_tools` gives them) and the completion's tokens + EOS."""
    from vpo_lightning.generation.models import prompt_token_ids

    prompt = prompt_token_ids(tokenizer, messages, tools)
    comp = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return {"prompt_ids": prompt, "completion_ids": comp}


def pack_examples(examples: list[dict[str, Any]], max_tokens: int, pack: bool = True,
                  mask_dtype: torch.dtype = torch.bool) -> list[dict[str, Tensor]]:
    """Rows for one batch of tokenised examples.

    With ``pack``, examples are placed first-fit (in order) into rows of at most ``max_tokens`` tokens (an
    example longer than that gets a row of its own); without, one example a row.

    Returns:
        One dict per row: ``input_ids`` and ``position_ids`` ``[1, T]``, ``attention_mask`` (``[1, 1, T, T]``
        block-diagonal causal when packed, ``[1, T]`` ones for a single example), ``gather`` ``[K]`` (the position
        whose hidden state predicts each completion token) and ``targets`` ``[K]`` (those tokens).
    """
    rows: list[list[dict[str, Any]]] = []
    sizes: list[int] = []
    for ex in examples:
        n = len(ex["prompt_ids"]) + len(ex["completion_ids"])
        for i, size in enumerate(sizes):
            if pack and size + n <= max_tokens:
                rows[i].append(ex)
                sizes[i] += n
                break
        else:
            rows.append([ex])
            sizes.append(n)
    out = []
    for row in rows:
        ids, pos, gather, targets, lengths, start = [], [], [], [], [], 0
        for ex in row:
            p, c = ex["prompt_ids"], ex["completion_ids"]
            n = len(p) + len(c)
            ids += p + c
            pos += list(range(n))
            gather += range(start + len(p) - 1, start + n - 1)  # the state before each completion token
            targets += c
            lengths.append(n)
            start += n
        mask = (packed_attention_mask(0, lengths, mask_dtype) if len(row) > 1
                else torch.ones(1, start, dtype=torch.long))
        out.append({
            "input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "attention_mask": mask,
            "gather": torch.tensor(gather, dtype=torch.long), "targets": torch.tensor(targets, dtype=torch.long),
        })
    return out


class SFTDataModule(StreamDataModule):
    """Demonstrations for ``vpo sft``: built from a task's training files, or read ready-made.

    Args:
        train_files: training data. With a ``builder``, task records (data/<task>/train.jsonl; val/test files are
            refused); with ``builder: none``, ready demonstrations in TRL's SFT formats (prompt-completion, standard
            or conversational; ``messages`` with assistant turns, each turn learnt) or ours (``{"messages": [...],
            "completion": str}``), from JSONL, JSON, Parquet, CSV, a ``save_to_disk`` folder or a Hub id, as
            ``vpo fit`` reads them. The loss is on the completions only.
        builder: a task's demonstration builder (``vpo_lightning/tasks/<name>/demos.py``): tooluse, maze (random
            walks), maze_shortest (random shortest routes) or maze_direct (shortest, then one-detour routes in
            chains), demonstrations built from the records; or none.
        formats: answers per demonstration: 1 = single answer, m > 1 = an m-answer chain; [1, 3] gives both,
            so that GRPO (single answers) and VPO (3-answer chains) can start from the same adapter.
        val_fraction: fraction of the training records held out (all their demonstrations) for the validation
            loss.
        max_val_examples: at most this many held-out demonstrations are scored at each validation.
        batch_size: demonstrations per optimizer step.
        max_tokens_per_row: packed row length (tokens); several demonstrations share a row.
        pack: pack demonstrations into rows (False: one a row; same loss, more passes).
        max_prompt_tokens: drop demonstrations whose prompt is longer (0 = keep all); match the RL config's
            data.max_prompt_tokens.
        max_completion_tokens: drop demonstrations whose completion (with EOS) is longer (0 = keep all); match the
            RL config's rollout.sampling.max_new_tokens so that demonstrations fit the generation budget.
        max_train_examples: use at most this many training demonstrations after filtering (0 = all).
        seed: seed of the demonstrations, of the held-out split and of the shuffling order.
        tokenizer: model name used to tokenise (linked to model.model.name by the CLI).
    """

    def __init__(
        self,
        train_files: list[str],
        builder: BuilderName = "none",
        formats: list[int] | None = None,
        val_fraction: float = 0.05,
        max_val_examples: int = 64,
        batch_size: int = 8,
        max_tokens_per_row: int = 2048,
        pack: bool = True,
        max_prompt_tokens: int = 0,
        max_completion_tokens: int = 0,
        max_train_examples: int = 0,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__(train_files, batch_size, seed, tokenizer)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
        self.builder, self.formats = builder, list(formats) if formats is not None else [1]
        self.val_fraction, self.max_val_examples = val_fraction, max_val_examples
        self.max_tokens_per_row, self.pack = max_tokens_per_row, pack
        self.max_prompt_tokens, self.max_completion_tokens = max_prompt_tokens, max_completion_tokens
        self.max_train_examples = max_train_examples
        self.train_examples: list[dict[str, Any]] = []
        self.val_examples: list[dict[str, Any]] = []

    # ---- building ------------------------------------------------------------------------------------------
    def demonstrations(self) -> list[dict[str, Any]]:
        """The untokenised demonstrations (built, or read from ready-made files)."""
        if self.builder != "none":
            from vpo_lightning.sft.demos import build_demos

            demos, skipped = build_demos(self.train_files, self.builder, self.formats, self.seed)
            if skipped:
                log.info("skipped %d training records whose prompt is also in val/test", skipped)
            return demos
        return [d for f in self.train_files for d in _read_demos(f)]

    def split(self, demos: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(train, held-out): whole source records are held out, so no prompt is on both sides."""
        sources = sorted({str(d.get("source_id", d["id"])) for d in demos})
        random.Random(self.seed).shuffle(sources)
        held = set(sources[: round(self.val_fraction * len(sources))])
        train = [d for d in demos if str(d.get("source_id", d["id"])) not in held]
        val = [d for d in demos if str(d.get("source_id", d["id"])) in held]
        return train, val

    def _tokenize(self, demos: list[dict[str, Any]], tok: Any) -> list[dict[str, Any]]:
        out, dropped = [], 0
        for d in demos:
            ex = tokenize_example(tok, d["messages"], d["completion"], template_tools(d))
            if (self.max_prompt_tokens and len(ex["prompt_ids"]) > self.max_prompt_tokens) or (
                    self.max_completion_tokens and len(ex["completion_ids"]) > self.max_completion_tokens):
                dropped += 1
                continue
            out.append({"id": d["id"], "m": d.get("m", 1), **ex})
        if dropped:
            log.info("dropped %d of %d demonstrations longer than data.max_prompt_tokens/max_completion_tokens",
                     dropped, len(demos))
        return out

    def setup(self, stage: str | None = None) -> None:
        if self.train_stream is not None:
            return
        from vpo_lightning.generation.models import load_tokenizer

        if not self.tokenizer:
            raise ValueError("data.tokenizer is not set (the CLI links it to model.model.name)")
        tok = load_tokenizer(self.tokenizer)
        train, val = self.split(self.demonstrations())
        self.train_examples = self._tokenize(train, tok)
        if self.max_train_examples:
            self.train_examples = self.train_examples[: self.max_train_examples]
        self.val_examples = self._tokenize(val, tok)[: self.max_val_examples or None]
        if len(self.train_examples) < self.batch_size:
            raise ValueError(f"{len(self.train_examples)} training demonstrations is fewer than one batch "
                             f"(data.batch_size={self.batch_size}): lower it or relax the length limits")
        log.info("SFT: %d training and %d held-out demonstrations", len(self.train_examples), len(self.val_examples))
        self.train_stream = self._stream(self.train_examples, self.batch_size, position=self._position)

    def val_dataloader(self) -> DataLoader | list:
        if not self.val_examples:  # data.val_fraction = 0: no validation loss
            return []
        return self._loader(self._stream(self.val_examples, self.batch_size, shuffle=False))


SFT_FORMATS = ("TRL prompt-completion {'prompt': str or messages, 'completion': str or [assistant message]}, "
               "TRL conversational {'messages': [..., {'role': 'assistant', ...}, ...]} (every assistant turn is "
               "learnt), or ours {'messages': [... user turn], 'completion': str}")


def _messages(value: Any, field: str, where: str) -> list[dict[str, Any]]:
    """A checked list of ``{role, content}`` messages (Arrow's null keys dropped)."""
    from vpo_lightning.training.records import _ROLES, _message

    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of {{role, content}} messages")
    out = [_message(m) for m in value]
    for i, msg in enumerate(out):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES or not isinstance(msg.get("content"), str):
            raise ValueError(f"{where}: {field}[{i}] must be {{'role': one of {sorted(_ROLES)}, 'content': str}}")
    return out


def _completion_text(value: Any, where: str) -> str:
    """A completion: a string (standard) or one assistant message (conversational)."""
    if isinstance(value, str):
        return value
    messages = _messages(value, "completion", where)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
        raise ValueError(f"{where}: a conversational 'completion' must be one assistant message, got roles "
                         f"{[m['role'] for m in messages]}")
    return messages[0]["content"]


def sft_examples(row: Any, where: str, default_id: str) -> list[dict[str, Any]]:
    """The demonstrations of one data row, each ``{"id", "messages" (the prompt), "completion", "source_id",
    "tools"}``; the loss is on the completion only (TRL's ``completion_only_loss`` / ``assistant_only_loss``).

    Accepted (:data:`SFT_FORMATS`): TRL's prompt-completion records, standard or conversational; TRL's conversational
    language-modelling records, ``messages`` with assistant turns, giving one demonstration per assistant turn (the
    conversation before it as the prompt, so earlier replies are context, not loss); and ours, ``messages`` ending
    with the user turn plus a ``completion`` string. Errors name ``where`` (file and line or row).
    """
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    rid = row.get("id") if row.get("id") is not None else default_id
    tools = row.get("tools")
    if tools is not None:
        from vpo_lightning.training.records import _tools

        tools = _tools(tools, where)
    if row.get("completion") is not None:
        if row.get("messages") is not None:
            prompt = _messages(row["messages"], "messages", where)
        elif row.get("prompt") is not None:
            from vpo_lightning.training.records import _prompt_messages

            prompt = _prompt_messages(row["prompt"], where)
            prompt = _messages(prompt, "prompt", where) if isinstance(row["prompt"], list) else prompt
        else:
            raise ValueError(f"{where}: a 'completion' needs a 'prompt' (or 'messages') to answer")
        if prompt[-1]["role"] == "assistant":
            raise ValueError(f"{where}: the prompt ends with an assistant turn; it must end with the turn the "
                             "completion answers (user)")
        return [{"id": rid, "source_id": rid, "messages": prompt, "completion": _completion_text(row["completion"],
                                                                                                 where),
                 "tools": tools}]
    if row.get("messages") is not None:
        messages = _messages(row["messages"], "messages", where)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
        if not turns:
            raise ValueError(f"{where}: 'messages' has no assistant turn to learn (a prompt-only record is `vpo fit` "
                             f"data); a demonstration is one of: {SFT_FORMATS}")
        return [{"id": f"{rid}-turn{k}" if len(turns) > 1 else rid, "source_id": rid, "messages": messages[:i],
                 "completion": messages[i]["content"], "tools": tools} for k, i in enumerate(turns, start=1)]
    if row.get("text") is not None:
        raise ValueError(f"{where}: a 'text' record (TRL's language-modelling format) has no prompt to condition on, "
                         f"and `vpo sft` learns completions only; give one of: {SFT_FORMATS}")
    raise ValueError(f"{where}: not a demonstration (fields {sorted(row)}); give one of: {SFT_FORMATS} (or set "
                     "data.builder to tooluse/maze for task records)")


def _read_demos(source: str | Path) -> list[dict[str, Any]]:
    """Ready-made demonstrations from any source ``vpo fit`` reads (JSONL, JSON, Parquet, CSV, a ``save_to_disk``
    folder, a Hub id), in any format of :func:`sft_examples`."""
    from vpo_lightning.training.records import read_rows

    out = [d for where, default_id, row in read_rows(source) for d in sft_examples(row, where, default_id)]
    if not out:
        raise ValueError(f"data {str(source)!r} has no demonstrations")
    return out

"""Prompt data: JSONL records (see docs/ARCHITECTURE.md), validated at setup, streamed B prompts a step.

Batches are yielded by an iterable dataset that knows its position: the number of batches the trainer has consumed.
Shuffling is a seeded permutation per epoch, so (seed, position) fixes what comes next, and the position is saved in
every checkpoint (``state_dict``), so a resumed run sees exactly the prompts an uninterrupted run would have seen.
With several ranks, each global batch of ``B * world_size`` prompts is split by rank, so ranks see disjoint prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

REQUIRED_FIELDS = ("messages",)
_ROLES = {"system", "user", "assistant", "tool"}


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in REQUIRED_FIELDS:
        if key not in record:
            raise ValueError(f"{where}: missing field {key!r} (each line needs at least 'messages')")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES or not isinstance(msg.get("content"), str):
            raise ValueError(f"{where}: messages[{i}] must be {{'role': one of {sorted(_ROLES)}, 'content': str}}")
    if messages[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message must have role 'user' (the prompt to answer)")
    from vpo_lightning.tasks.code.build import check_code_record

    check_code_record(record, where)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a JSONL prompt file; errors name the file, the line and the problem."""
    path = Path(path)
    if path.is_dir():
        inside = sorted(p.name for p in path.glob("*.jsonl"))[:4]
        hint = f"name a file inside it ({', '.join(inside)})" if inside else "name a JSONL file (one record per line)"
        raise ValueError(f"data file {str(path)!r} is a directory: {hint} in data.train_files / data.val_files")
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist (check data.train_files / data.val_files)")
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text (byte {raw[err.start]:#04x} at column {err.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
            _check_record(record, where)
            record.setdefault("id", f"{path.stem}-{lineno}")
            records.append(record)
    if not records:
        raise ValueError(f"data file {str(path)!r} is empty: it needs one JSON record per line")
    return records


class PromptStream(IterableDataset):
    """Yields batches ``{"records": [...], "position": int}`` starting at ``position``; see the module docstring."""

    def __init__(self, records: list[dict], batch_size: int, seed: int, shuffle: bool = True) -> None:
        self.records, self.batch_size, self.seed, self.shuffle = records, batch_size, seed, shuffle
        self.position = 0  # batches consumed by training (global, counted on this rank)
        self.rank, self.world_size = 0, 1

    def __len__(self) -> int:
        return max(1, len(self.records) // (self.batch_size * self.world_size))

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        per_epoch, global_b = len(self), self.batch_size * self.world_size
        epoch, offset = divmod(self.position, per_epoch)
        order = self._order(epoch)
        for i in range(offset, per_epoch):
            chunk = order[i * global_b : (i + 1) * global_b]
            mine = chunk[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]
            yield {"records": [self.records[j] for j in mine], "indices": mine, "position": epoch * per_epoch + i}


def _collate(batch: dict[str, Any]) -> dict[str, Any]:
    return batch  # batches are built whole by PromptStream


class StreamDataModule(L.LightningDataModule):
    """What the prompt and SFT data modules share: rank-split streams, and a training position that every checkpoint
    saves and a resume restores. Subclasses set ``train_stream`` (None until ``setup``) and ``_position``."""

    train_stream: PromptStream | None
    _position: int

    def _stream(self, records: list[dict], batch_size: int, shuffle: bool = True, position: int = 0) -> PromptStream:
        """A stream over ``records`` with this module's seed, split by rank when a trainer is attached."""
        stream = PromptStream(records, batch_size, self.seed, shuffle=shuffle)
        stream.position = position
        if self.trainer is not None:
            stream.rank, stream.world_size = self.trainer.global_rank, self.trainer.world_size
        return stream

    @staticmethod
    def _loader(stream: PromptStream) -> DataLoader:
        return DataLoader(stream, batch_size=None, collate_fn=_collate)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_stream)

    def mark_consumed(self, position: int) -> None:
        """Called for each training batch: the next batch to serve is ``position + 1``."""
        self._position = position + 1
        if self.train_stream is not None:
            self.train_stream.position = self._position

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = int(state.get("position", 0))
        if self.train_stream is not None:
            self.train_stream.position = self._position


class PromptDataModule(StreamDataModule):
    """Streams prompts from JSONL files.

    Args:
        train_files: JSONL files with training prompts (one record a line; see docs/ARCHITECTURE.md).
        val_files: JSONL files with validation prompts (optional).
        batch_size: prompts per step (B); each prompt is expanded to G chains by the rollout.
        val_batch_size: prompts per validation step.
        max_val_prompts: use at most this many validation prompts (the first ones in the file).
        max_prompt_tokens: drop prompts longer than this after the chat template (0 = keep all).
        max_train_prompts: use at most this many training prompts after filtering (0 = all).
        seed: seed of the shuffling order.
        tokenizer: model name used to measure prompt lengths (linked to model.model.name by the CLI).
    """

    def __init__(
        self,
        train_files: list[str],
        val_files: list[str] | None = None,
        batch_size: int = 2,
        val_batch_size: int = 4,
        max_val_prompts: int = 32,
        max_prompt_tokens: int = 0,
        max_train_prompts: int = 0,
        seed: int = 0,
        tokenizer: str | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.train_files, self.val_files = list(train_files), list(val_files or [])
        self.batch_size, self.val_batch_size, self.max_val_prompts = batch_size, val_batch_size, max_val_prompts
        self.max_prompt_tokens, self.max_train_prompts = max_prompt_tokens, max_train_prompts
        self.seed, self.tokenizer = seed, tokenizer
        self.train_stream: PromptStream | None = None
        self.val_records: list[dict] = []
        self._position = 0

    def _filter_length(self, records: list[dict]) -> list[dict]:
        if not self.max_prompt_tokens or not self.tokenizer:
            return records
        from vpo_lightning.models import load_tokenizer, prompt_token_ids

        tok = load_tokenizer(self.tokenizer)
        lengths = [len(prompt_token_ids(tok, r["messages"])) for r in records]
        kept = [r for r, n in zip(records, lengths) if n <= self.max_prompt_tokens]
        if not kept:
            raise ValueError(
                f"data.max_prompt_tokens={self.max_prompt_tokens} drops every prompt "
                f"(shortest is {min(lengths)} tokens): raise it"
            )
        return kept

    def setup(self, stage: str | None = None) -> None:
        if self.train_stream is None and stage in (None, "fit"):
            records = self._filter_length([r for f in self.train_files for r in read_jsonl(f)])
            if self.max_train_prompts:
                records = records[: self.max_train_prompts]
            self.train_stream = self._stream(records, self.batch_size, position=self._position)
            if len(records) < self.batch_size * self.train_stream.world_size:
                raise ValueError(f"{len(records)} training prompts is fewer than one batch (data.batch_size)")
        if not self.val_records and self.val_files:
            val = [r for f in self.val_files for r in read_jsonl(f)]
            self.val_records = self._filter_length(val)[: self.max_val_prompts or None]

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._stream(self.val_records, self.val_batch_size, shuffle=False))

"""Prompt data: records from JSONL, JSON, Parquet, CSV or a saved ``datasets`` folder
(:mod:`vpo_lightning.training.records`; TRL's ``prompt`` formats too), validated at setup, streamed B prompts a step.

Batches are yielded by an iterable dataset that knows its position: the number of batches the trainer has consumed.
Shuffling is a seeded permutation per epoch, so (seed, position) fixes what comes next, and the position is saved in
every checkpoint (``state_dict``), so a resumed run sees exactly the prompts an uninterrupted run would have seen.
With several ranks, each global batch of ``B * world_size`` prompts is split by rank, so ranks see disjoint prompts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from vpo_lightning.training.records import read_records, template_tools

__all__ = ["PromptDataModule", "PromptStream", "StreamDataModule"]

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
    saves and a resume restores. Subclasses set ``train_stream`` in ``setup``."""

    def __init__(self, train_files: list[str], batch_size: int, seed: int, tokenizer: str | None) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {batch_size}")
        self.train_files, self.batch_size, self.seed, self.tokenizer = list(train_files), batch_size, seed, tokenizer
        self.train_stream: PromptStream | None = None
        self._position = 0

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
    """Streams prompts from data files.

    Args:
        train_files: training prompts: JSONL files (one record a line; see docs/ARCHITECTURE.md), or JSON, Parquet,
            CSV files, folders written by ``datasets``' ``save_to_disk``, Hub dataset ids (``owner/name[:split]``,
            needs a Hub connection). Records are ours (``messages``) or TRL's (``prompt``): docs/COMING_FROM_TRL.md.
        val_files: validation prompts, in the same forms (optional).
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
        super().__init__(train_files, batch_size, seed, tokenizer)
        self.val_files = list(val_files or [])
        self.val_batch_size, self.max_val_prompts = val_batch_size, max_val_prompts
        self.max_prompt_tokens, self.max_train_prompts = max_prompt_tokens, max_train_prompts
        self.val_records: list[dict] = []

    def _filter_length(self, records: list[dict]) -> list[dict]:
        if not self.max_prompt_tokens or not self.tokenizer:
            return records
        from vpo_lightning.generation.models import load_tokenizer, prompt_token_ids

        tok = load_tokenizer(self.tokenizer)
        lengths = [len(prompt_token_ids(tok, r["messages"], template_tools(r))) for r in records]
        kept = [r for r, n in zip(records, lengths) if n <= self.max_prompt_tokens]
        if not kept:
            raise ValueError(
                f"data.max_prompt_tokens={self.max_prompt_tokens} drops every prompt "
                f"(shortest is {min(lengths)} tokens): raise it"
            )
        return kept

    def setup(self, stage: str | None = None) -> None:
        if self.train_stream is None and stage in (None, "fit"):
            records = self._filter_length([r for f in self.train_files for r in read_records(f)])
            if self.max_train_prompts:
                records = records[: self.max_train_prompts]
            self.train_stream = self._stream(records, self.batch_size, position=self._position)
            if len(records) < self.batch_size * self.train_stream.world_size:
                raise ValueError(f"{len(records)} training prompts is fewer than one batch (data.batch_size)")
        if not self.val_records and self.val_files:
            val = [r for f in self.val_files for r in read_records(f)]
            self.val_records = self._filter_length(val)[: self.max_val_prompts or None]

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._stream(self.val_records, self.val_batch_size, shuffle=False))

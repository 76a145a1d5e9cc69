"""Prompt-shared packing for the training forward passes.

The G chains of a group share their prompt. The plain micro-batch ``[n, P + L]`` runs the prompt through the model
n times; a packed row runs it once: ``[prompt | completion_1 | ... | completion_n]`` with a 4D attention mask in
which each completion sees the prompt and its own earlier tokens, and position ids that restart after the prompt
for every completion. Completions are cut to their real length, so the row also carries no padding. The log-probs
(and their gradients, which reach the prompt's hidden states from every completion) equal the plain computation's
up to floating-point summation order.

With prompts of ~500 tokens, G = 8 and ~192 generated tokens, a group costs 500 + 8 * 192 = 2036 token positions
instead of 8 * 692 = 5536.
"""

from __future__ import annotations

import torch
from torch import Tensor


def packing_enabled(share_prompt: bool, attn_implementation: str) -> bool:
    """Whether training packs prompts (``optim.share_prompt``): flash_attention_2 takes no custom 4D masks."""
    return share_prompt and attn_implementation != "flash_attention_2"


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, prompt_length: int) -> list[list[int]]:
    """Rows with identical prompts (real tokens, padding ignored), in first-seen order.

    Groups are found from the tokens, not from the group index, so per-chain prompts (goal-conditioned GRPO)
    simply give more groups.
    """
    seen: dict[tuple[int, ...], list[int]] = {}
    for i in range(input_ids.shape[0]):
        real = input_ids[i, :prompt_length][attention_mask[i, :prompt_length].bool()]
        seen.setdefault(tuple(real.tolist()), []).append(i)
    return list(seen.values())


def packed_attention_mask(prompt_len: int, lengths: list[int], dtype: torch.dtype) -> Tensor:
    """Mask ``[1, 1, T, T]``, T = prompt_len + sum(lengths): boolean (True = attend; for SDPA) when ``dtype`` is
    ``torch.bool``, else additive (0 = attend, dtype min = blocked; for eager attention).

    Prompt positions are causal among themselves; completion i attends to the whole prompt and causally to itself.
    """
    seg = torch.cat([torch.zeros(prompt_len, dtype=torch.long)]
                    + [torch.full((n,), i + 1, dtype=torch.long) for i, n in enumerate(lengths)])  # [T]
    T = seg.shape[0]
    pos = torch.arange(T)
    causal = pos[None, :] <= pos[:, None]  # [T, T] key <= query
    same_or_prompt = (seg[None, :] == seg[:, None]) | (seg[None, :] == 0)  # [T, T] key in own segment or prompt
    allowed = causal & same_or_prompt
    if dtype == torch.bool:
        return allowed[None, None]  # [1, 1, T, T]
    mask = torch.zeros(T, T, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]  # [1, 1, T, T]


def pack_rows(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, prompt_length: int,
              rows: list[int], dtype: torch.dtype = torch.bool) -> dict[str, Tensor]:
    """One packed row for ``rows`` (which must share a prompt).

    Returns a dict with ``input_ids`` and ``position_ids`` ``[1, T]``, ``attention_mask`` ``[1, 1, T, T]``,
    ``gather`` ``[n, L]`` (the position of the hidden state that predicts each completion token; 0 on padding),
    ``targets`` ``[n, L]`` and ``completion_mask`` ``[n, L]`` cut to the longest real completion L, and
    ``segments`` ``[1 + n]`` (the prompt's length, then each completion's: what
    :func:`vpo_lightning.generation.attention.segment_attention` needs instead of the mask).
    """
    P = prompt_length
    first = rows[0]
    prompt = input_ids[first, :P][attention_mask[first, :P].bool()]  # [p]
    p = prompt.shape[0]
    lengths = [int(attention_mask[i, P:].sum()) for i in rows]  # real generated tokens per row
    L = max(1, max(lengths))
    n = len(rows)
    pieces, positions = [prompt], [torch.arange(p)]
    gather = torch.zeros(n, L, dtype=torch.long)  # [n, L]
    targets = torch.zeros(n, L, dtype=torch.long)  # [n, L]
    start = p
    for j, (i, length) in enumerate(zip(rows, lengths)):
        comp = input_ids[i, P : P + length]  # [length]
        pieces.append(comp)
        positions.append(torch.arange(p, p + length))
        if length:
            # token 0 is predicted by the last prompt state, token t > 0 by the state of token t - 1
            gather[j, :length] = torch.cat([torch.tensor([p - 1]), torch.arange(start, start + length - 1)])
            targets[j, :length] = comp
        start += length
    cmask = completion_mask[rows, :L]  # [n, L] (completion_mask is at least max(1, longest) wide)
    return {
        "input_ids": torch.cat(pieces)[None],  # [1, T]
        "position_ids": torch.cat(positions)[None],  # [1, T]
        "attention_mask": packed_attention_mask(p, lengths, dtype),  # [1, 1, T, T]
        "gather": gather, "targets": targets, "completion_mask": cmask,
        "segments": torch.tensor([p, *lengths]),  # [1 + n] the prompt's and each completion's length
    }


def packed_micro_batches(input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, prompt_length: int,
                         size: int, dtype: torch.dtype = torch.bool) -> list[dict[str, Tensor]]:
    """Split every prompt group into packed rows of at most ``size`` completions (longest first).

    Each dict is :func:`pack_rows`' output plus ``index`` ``[n]``, the rollout rows it holds.
    """
    out = []
    lengths = attention_mask[:, prompt_length:].sum(1)  # [N]
    for rows in prompt_groups(input_ids, attention_mask, prompt_length):
        rows = sorted(rows, key=lambda i: -int(lengths[i]))
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            mb = pack_rows(input_ids, attention_mask, completion_mask, prompt_length, chunk, dtype)
            mb["index"] = torch.tensor(chunk, dtype=torch.long)
            out.append(mb)
    return out

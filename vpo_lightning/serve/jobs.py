"""What a request of ``vpo serve`` is once admitted (a :class:`Job`), what it returns (a :class:`Choice`), and how its
tokens are reported (OpenAI's ``logprobs.content`` with exact bytes). Shared by the batch worker
(:mod:`~vpo_lightning.serve.batching`), the decode groups (:mod:`~vpo_lightning.serve.continuous`) and the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vpo_lightning.serve.openai_api import SamplingKey

__all__ = ["BYTE_DECODER", "Choice", "Job", "logprob_entries", "token_bytes"]


@dataclass
class Job:
    """One queued request: its prompt, how many choices, its sampling key and stop strings.

    ``logprobs``: None, or the number of top alternatives to give per token (0-20). ``events``: for a streamed
    request, a queue that receives ``(choice index, token id, log-prob, [(id, log-prob)...] alternatives)`` for each
    token as it is generated (and ``None`` when the job is done: the server adds that).
    """

    prompt_ids: list[int]
    n: int
    key: SamplingKey
    stops: tuple[str, ...] = ()
    future: Future = field(default_factory=Future)
    logprobs: int | None = None
    events: Any = None  # anything with put(): a queue.Queue, or the server's hand-over to its event loop
    client: str = ""  # who sent it (the peer address): clients take turns at the head of the queue
    dropped: bool = False  # the client hung up: skip it when pending, stop its rows when generating
    joined: float = 0.0  # time.monotonic() when it joined a decode group


@dataclass
class Choice:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    tokens: int  # generated tokens counted in usage
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's logprobs.content, one entry per token of text


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE piece uses -> that byte."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = list(visible), 0
    for b in range(256):
        if b not in visible:
            visible.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(visible, chars)}


BYTE_DECODER = _byte_decoder()


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """The exact bytes each token stands for (OpenAI's ``bytes``): byte-level BPE pieces through GPT-2's alphabet,
    SentencePiece byte-fallback pieces (``<0xE2>``) as that byte, other pieces as UTF-8 with ``▁`` as a space."""
    pieces = tokenizer.convert_ids_to_tokens(list(ids))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    out = []
    for piece in pieces:
        piece = piece or ""
        if byte_level and all(c in BYTE_DECODER for c in piece):
            out.append(bytes(BYTE_DECODER[c] for c in piece))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode("utf-8"))
    return out


def logprob_entries(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                    tops: Sequence[Sequence[tuple[int, float]]], top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: per token its text, log-prob, bytes and up to ``top`` alternatives (those
    the sampler could draw: alternatives that top-k/top-p ruled out, log-prob -inf, are left out)."""
    alternatives = sorted({t for row in tops for t, _ in row[:top]})
    pieces = dict(zip(alternatives, token_bytes(tokenizer, alternatives)))
    out = []
    for raw, lp, row in zip(token_bytes(tokenizer, ids), logprobs, tops):
        out.append({"token": raw.decode("utf-8", "replace"), "logprob": lp, "bytes": list(raw),
                    "top_logprobs": [{"token": pieces[t].decode("utf-8", "replace"), "logprob": v,
                                      "bytes": list(pieces[t])} for t, v in row[:top] if v > -float("inf")]})
    return out

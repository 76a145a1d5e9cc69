"""Multi-response chains: the m-answer instruction appended to a prompt, and the parser that splits a chain.

VPO-SPEC section 2. One completion ("chain") holds m candidate answers, each in numbered tags
(``<response_i>``; ``<route_i>`` for mazes) or, for code, m fenced python blocks separated by ``---`` lines.
Pure Python. The parser scans with ``str.find`` and single-pattern regex searches (linear time), so megabytes of
model output cannot make it backtrack, and it never raises on any text: a missing, unclosed or empty block is
``None``.

The rules follow the reference implementation (``ryanboldi/vpo``; docs/FIDELITY.md): ``<response_i>`` blocks
are read case-sensitively with no fallback (``extract_numbered_tags``); ``<route_i>`` blocks are read in any case,
and a maze chain with none of them falls back, in order, to its ``---``-separated parts (at least two), its
closed single-answer blocks (``<route>`` or the reference's ``<answer>``, at least two), and finally the whole text
as its first answer (``parse_multi_routes``). :func:`distinct` drops repeated answers of one chain (the maze's
"identical routes count once").
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

Family = Literal["response", "route", "fence"]
FAMILIES: tuple[str, ...] = ("response", "route", "fence")

# Language tags accepted on an opening fence; a block tagged with anything else (```bash, ```text) is skipped.
_PYTHON_TAGS = frozenset({"", "python", "python3", "py"})
_FENCE = "```"


def _check(m: int, family: str) -> None:
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"m must be a positive int (number of answers per chain), got {m!r}")
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def build_instruction(m: int, family: Family = "response") -> str:
    """The instruction appended to the last user message to ask for an m-answer chain.

    Args:
        m: number of candidate answers requested (>= 1).
        family: ``"response"`` (``<response_i>`` tags), ``"route"`` (``<route_i>`` tags, maze) or ``"fence"``
            (m fenced python blocks separated by ``---`` lines, code).

    Returns:
        The instruction text, starting with a blank line so it can be appended to a prompt as is.

    Raises:
        ValueError: ``m`` < 1 or an unknown ``family``.
    """
    _check(m, family)
    ask = (
        f"\n\nGive {m} genuinely different attempts at this task, not paraphrases of one answer: each attempt "
        "should make a different choice (a different tool, different argument values, a different route or "
        "a different line of reasoning), so that together they cover the plausible answers. "
    )
    if family == "fence":
        blocks = "\n---\n".join(f"```python\n# attempt {i}\n```" for i in range(1, m + 1))
        return (
            ask + f"Write each attempt as a complete program in its own ```python fenced code block, {m} blocks "
            "in total, separated by a line containing only ---, like this:\n"
            f"{blocks}\n"
            "Inside each block, follow exactly the format the task asks for a single solution."
        )
    tag = "response" if family == "response" else "route"
    layout = "\n".join(f"<{tag}_{i}>...</{tag}_{i}>" for i in range(1, m + 1))
    return (
        ask + f"Wrap attempt i in <{tag}_i> and </{tag}_i> tags, {m} blocks in total, in this layout:\n"
        f"{layout}\n"
        "Inside each block, use exactly the answer format the task asks for a single answer."
    )


def tagged_block(text: str, tag: str) -> str | None:
    """Same result as ``re.search(f"<{tag}>(.*?)</{tag}>", text, re.DOTALL)``, in linear time.

    The leftmost match starts at the first opening tag: if the first opening tag has no closing tag after it,
    no later one has either. Nested or repeated opening tags stay inside the content, as with the regex.
    """
    open_, close = f"<{tag}>", f"</{tag}>"
    start = text.find(open_)
    if start < 0:
        return None
    start += len(open_)
    end = text.find(close, start)
    return None if end < 0 else text[start:end]


def _fenced_blocks(text: str, m: int) -> list[str]:
    """The contents of the first ``m`` closed python code fences (``` with no tag or a python tag)."""
    blocks: list[str] = []
    pos = 0
    while len(blocks) < m:
        start = text.find(_FENCE, pos)
        if start < 0:
            break
        line_end = text.find("\n", start + len(_FENCE))
        if line_end < 0:
            break  # an opening fence on the last line has no body
        body_start = line_end + 1
        end = text.find(_FENCE, body_start)
        if end < 0:
            break  # unclosed final block: treated as missing, like an unclosed tag
        if text[start + len(_FENCE) : line_end].strip().lower() in _PYTHON_TAGS:
            blocks.append(text[body_start:end])
        pos = end + len(_FENCE)
    return blocks


def parse_chain(text: str, m: int, family: Family = "response") -> list[str | None]:
    """Split a chain into its m candidate answers.

    For ``"response"``, candidate i is the first non-greedy DOTALL match of ``<response_i>(.*?)</response_i>``.
    For ``"route"``, the same with ``<route_i>`` in any case; when the chain has no closed ``<route_i>`` block at
    all, the reference's fallbacks apply (module docstring). For ``"fence"``, the candidates are the first m
    closed code fences whose language tag is empty or python; the ``---`` separators are not needed to parse.

    Args:
        text: the generated chain; any string (unclosed or nested tags, any size, any unicode).
        m: number of candidates expected (>= 1).
        family: tag family, as in :func:`build_instruction`.

    Returns:
        Exactly ``m`` entries, the block contents with surrounding whitespace stripped (code blocks keep the
        indentation of their first line); ``None`` where the block is missing, unclosed or whitespace-only.
        Never raises on any ``text`` (a non-string gives all ``None``).

    Raises:
        ValueError: ``m`` < 1 or an unknown ``family`` (caller bugs, not model output).
    """
    _check(m, family)
    if not isinstance(text, str):
        return [None] * m
    if family == "fence":
        raw: list[str | None] = list(_fenced_blocks(text, m))
    elif family == "route":
        raw = [_block_ci(text, f"route_{i}") for i in range(1, m + 1)]
        if all(block is None for block in raw):
            raw = list(_route_fallback(text))
    else:
        raw = [tagged_block(text, f"response_{i}") for i in range(1, m + 1)]
    raw = (raw + [None] * m)[:m]
    return [_clean(block, family) for block in raw]


def _block_ci(text: str, tag: str) -> str | None:
    """:func:`tagged_block` with the tags matched in any case (linear time: two single-pattern searches)."""
    opening = re.compile(f"<{tag}>", re.IGNORECASE).search(text)
    if opening is None:
        return None
    closing = re.compile(f"</{tag}>", re.IGNORECASE).search(text, opening.end())
    return None if closing is None else text[opening.end() : closing.start()]


def _all_blocks_ci(text: str, tag: str) -> list[str]:
    """Every closed ``<tag>...</tag>`` block, left to right (non-overlapping, as ``re.findall`` of ``.*?``)."""
    opening, closing = re.compile(f"<{tag}>", re.IGNORECASE), re.compile(f"</{tag}>", re.IGNORECASE)
    blocks, pos = [], 0
    while (start := opening.search(text, pos)) is not None:
        end = closing.search(text, start.end())
        if end is None:
            break
        blocks.append(text[start.end() : end.start()])
        pos = end.end()
    return blocks


def _route_fallback(text: str) -> list[str]:
    """The reference's fallbacks for a maze chain without ``<route_i>`` blocks: ``---``-separated parts, else
    closed single-answer blocks (``<route>``, else ``<answer>``), each only when there are at least two; else the
    whole text as the first answer."""
    parts = [p.strip() for p in text.split("---") if p.strip()]
    if len(parts) >= 2:
        return parts
    for tag in ("route", "answer"):
        blocks = _all_blocks_ci(text, tag)
        if len(blocks) >= 2:
            return blocks
    return [text]


def distinct(candidates: Sequence[str | None],
             key: Callable[[str], Hashable | None]) -> tuple[list[str | None], int]:
    """Drop repeated answers of one chain: a candidate whose ``key`` equals an earlier candidate's becomes
    ``None`` (absent, scoring 0), so identical answers count once, as the reference's maze reward does. A ``None``
    key (e.g. a route with no moves) is never a repeat.

    Returns:
        The candidates with repeats set to ``None``, and the number of repeats dropped.
    """
    seen: set[Hashable] = set()
    out: list[str | None] = []
    for cand in candidates:
        k = key(cand) if cand is not None else None
        if k is not None and k in seen:
            out.append(None)
            continue
        if k is not None:
            seen.add(k)
        out.append(cand)
    return out, sum(a is not None and b is None for a, b in zip(candidates, out))


def _clean(block: str | None, family: str) -> str | None:
    if block is None or not block.strip():
        return None
    # Code keeps the indentation of its first line (stripping it could break a program); text is stripped.
    return block.lstrip("\r\n").rstrip() if family == "fence" else block.strip()


def count_parsed(text: str, m: int, family: Family = "response") -> int:
    """How many of the m blocks of ``text`` parse to a non-empty answer (a logging helper)."""
    return sum(block is not None for block in parse_chain(text, m, family))

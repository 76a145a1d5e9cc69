"""Multi-response chains: the m-answer instruction appended to a prompt, and the parser that splits a chain.

VPO-SPEC section 2. One completion ("chain") holds m candidate answers, each in numbered tags
(``<response_i>``; ``<route_i>`` for mazes) or, for code, m fenced python blocks separated by ``---`` lines.
Pure Python. The parser scans with ``str.find`` (linear time), so megabytes of model output cannot make it
backtrack, and it never raises on any text: a missing, unclosed or empty block is ``None``.
"""

from __future__ import annotations

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

    For ``"response"``/``"route"``, candidate i is the first non-greedy DOTALL match of
    ``<response_i>(.*?)</response_i>`` (``<route_i>``). For ``"fence"``, the candidates are the first m closed
    code fences whose language tag is empty or python; the ``---`` separators are not needed to parse.

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
        raw += [None] * (m - len(raw))
    else:
        tag = "response" if family == "response" else "route"
        raw = [tagged_block(text, f"{tag}_{i}") for i in range(1, m + 1)]
    return [_clean(block, family) for block in raw]


def _clean(block: str | None, family: str) -> str | None:
    if block is None or not block.strip():
        return None
    # Code keeps the indentation of its first line (stripping it could break a program); text is stripped.
    return block.lstrip("\r\n").rstrip() if family == "fence" else block.strip()


def count_parsed(text: str, m: int, family: Family = "response") -> int:
    """How many of the m blocks of ``text`` parse to a non-empty answer (a logging helper)."""
    return sum(block is not None for block in parse_chain(text, m, family))

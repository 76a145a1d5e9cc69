"""Tests for the multi-response chain instruction and parser (VPO-SPEC section 2)."""

import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vpo_lightning.core.chains import build_instruction, count_parsed, parse_chain


def _regex_reference(text: str, m: int, tag: str = "response") -> list[str | None]:
    """The spec's definition, with Python's regex (fine on small inputs)."""
    out = []
    for i in range(1, m + 1):
        match = re.search(f"<{tag}_{i}>(.*?)</{tag}_{i}>", text, re.DOTALL)
        out.append(match.group(1).strip() if match and match.group(1).strip() else None)
    return out


@pytest.mark.parametrize("family, tag", [("response", "<response_3>"), ("route", "<route_3>"), ("fence", "```python")])
def test_instruction_names_every_block_and_asks_for_different_attempts(family, tag):
    text = build_instruction(3, family)
    assert tag in text
    assert "3" in text and "different" in text and "paraphrase" in text
    assert "single" in text  # the task's own single-answer format applies inside each block
    if family == "fence":
        assert "\n---\n" in text and text.count("```python") == 4  # 1 mention + 3 layout blocks
    else:
        assert "<response_4>" not in text and "<route_4>" not in text


def test_instruction_round_trips_through_the_parser():
    # The layout the instruction shows, with "..." as content, parses to "..." in every slot.
    for family in ("response", "route"):
        assert parse_chain(build_instruction(4, family), 4, family) == ["..."] * 4


def test_parse_basic_missing_and_empty():
    text = "think first <response_1> A </response_1>\n<response_2>\n \n</response_2><response_4>D</response_4>"
    # 1 -> "A" (stripped), 2 -> whitespace only -> None, 3 -> missing -> None, 4 -> "D"
    assert parse_chain(text, 4) == ["A", None, None, "D"]
    assert count_parsed(text, 4) == 2


def test_parse_non_greedy_first_match_and_nesting():
    # Non-greedy: stops at the first closing tag; the second block of the same number is ignored.
    assert parse_chain("<response_1>a</response_1> <response_1>b</response_1>", 1) == ["a"]
    # A repeated opening tag stays inside the content, exactly like the regex.
    text = "<response_1>x <response_1> y</response_1>"
    assert parse_chain(text, 1) == _regex_reference(text, 1) == ["x <response_1> y"]
    # Unclosed tag -> None; a closing tag before the opening one does not count.
    assert parse_chain("</response_1><response_1>open", 1) == [None]
    # <response_1> must not match inside <response_10>.
    assert parse_chain("<response_10>ten</response_10>", 1) == [None]


def test_parse_route_family():
    assert parse_chain("<route_1>U R</route_1><route_2>D</route_2>", 2, "route") == ["U R", "D"]
    # the reference's maze parser (parse_multi_routes): tags in any case; one closed tag is enough, the rest absent
    assert parse_chain("<ROUTE_2>D</ROUTE_2> and prose R R", 3, "route") == [None, "D", None]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("R R\n---\nD D\n---\nL", ["R R", "D D", "L"]),  # no <route_i>: the ---separated parts
        ("<route>R</route> or <answer>D</answer>... <route>U</route>", ["R", "U", None]),  # >= 2 single blocks
        ("<answer>R</answer><answer>D D</answer>", ["R", "D D", None]),  # the reference's <answer> blocks
        ("just R R D", ["just R R D", None, None]),  # nothing else: the whole text is the first answer
        ("<route>R R</route>", ["<route>R R</route>", None, None]),  # one block only: whole text (reads as it)
        ("<route_1>R", ["<route_1>R", None, None]),  # an unclosed numbered tag is no block: whole text
    ],
)
def test_route_chain_fallbacks(text, expected):
    assert parse_chain(text, 3, "route") == expected


def test_response_family_has_no_fallback():
    # the reference's extract_numbered_tags: case-sensitive, missing blocks are empty, no fallback
    assert parse_chain("R\n---\nD", 2) == [None, None]
    assert parse_chain("<RESPONSE_1>x</RESPONSE_1>", 1) == [None]


def test_distinct_counts_identical_answers_once():
    from vpo_lightning.core.chains import distinct

    key = lambda text: tuple(text.split()) or None  # noqa: E731
    assert distinct(["R  R", "R R", None, "D", "R R"], key) == (["R  R", None, None, "D", None], 2)
    assert distinct(["", ""], key) == (["", ""], 0)  # no key (no moves): never a repeat


def test_parse_fence_family():
    text = (
        "Plan.\n```python\ndef f():\n    return 1\n```\n---\n```\nprint(2)\n```\n---\n"
        "```bash\nls\n```\n```py\nx = 3\n```\n```python\nextra = 4\n```"
    )
    # python, untagged and py blocks count; the bash block is skipped; only the first m = 3 are taken.
    assert parse_chain(text, 3, "fence") == ["def f():\n    return 1", "print(2)", "x = 3"]
    # An empty block is None, an unclosed block is missing, and a short chain is padded with None.
    assert parse_chain("```python\n\n```\n---\n```python\nunclosed", 3, "fence") == [None, None, None]
    # Indentation of the first code line is kept.
    assert parse_chain("```python\n    x = 1\n```", 1, "fence") == ["    x = 1"]


def test_bad_arguments_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="m must"):
        parse_chain("x", 0)
    with pytest.raises(ValueError, match="family"):
        build_instruction(2, "xml")  # type: ignore[arg-type]
    assert parse_chain(None, 2) == [None, None]  # type: ignore[arg-type]  # not text: nothing parses


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(st.sampled_from(list("<>/_123responsft`\n ab") + ["<response_1>", "</response_1>", "<response_2>",
                  "</response_2>", "```python\n", "```\n", "é😀\x00"]), max_size=40).map("".join),
    m=st.integers(1, 4),
    family=st.sampled_from(["response", "route", "fence"]),
)
def test_parse_never_raises_and_returns_m_entries(text, m, family):
    out = parse_chain(text, m, family)
    assert len(out) == m
    assert all(x is None or (isinstance(x, str) and x.strip()) for x in out)
    if family == "response":
        assert out == _regex_reference(text, m)  # the str.find scanner equals the spec's regex


@settings(max_examples=50, deadline=None)
@given(text=st.text(max_size=200), m=st.integers(1, 5))
def test_parse_arbitrary_unicode(text, m):
    assert len(parse_chain(text, m)) == m and len(parse_chain(text, m, "fence")) == m


# Adversarial for a backtracking regex: a million opening tags and no closing tag, plus a real block at the end.
HOSTILE = "<response_1>" * 100_000 + "x" * 1_000_000 + "```" * 100_000


def test_megabyte_hostile_chain_parses():
    assert parse_chain(HOSTILE + "<response_2>found</response_2>", 3) == [None, "found", None]
    assert parse_chain(HOSTILE, 3, "fence") == [None, None, None]


@pytest.mark.slow
def test_megabyte_chain_parses_quickly():
    """The timing half (slow tier: wall-clock bounds are flaky on a loaded machine): linear time, well under 1 s."""
    start = time.perf_counter()
    parse_chain(HOSTILE + "<response_2>found</response_2>", 3)
    parse_chain(HOSTILE, 3, "fence")
    assert time.perf_counter() - start < 1.0

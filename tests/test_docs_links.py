"""Every relative link in the README and the docs resolves: the file exists and an ``#anchor`` into a markdown file
names one of its headings (GitHub's slugs). The README links to the docs pages its measurements moved to (issue 42),
so a renamed page or heading would otherwise leave a dead link."""
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(page for page in {REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("*/README.md"),
                                 *REPO.glob("data/*/README.md")} if not page.relative_to(REPO).parts[0].startswith("."))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _outside_code(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def slugs(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page: lower case, punctuation dropped, spaces to hyphens."""
    found: dict[str, int] = {}
    for _, line in _outside_code(page.read_text()):
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            found[slug] = found.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in found.items() for n in range(count + 1)}


def dead_links(page: Path) -> list[str]:
    dead = []
    for number, line in _outside_code(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}:{number}: ({target})"
            if not dest.exists():
                dead.append(f"{where}: no file {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
            elif anchor and dest.suffix == ".md" and anchor not in slugs(dest):
                dead.append(f"{where}: no heading for #{anchor} in {dest.name}")
    return dead


def test_slugs_follow_github():
    page = REPO / "README.md"
    assert "speed-and-memory-vpo-plan" in slugs(page)  # "## Speed and memory, `vpo plan`"
    assert "estimators-vpo-and-the-baselines-one-key-apart" in slugs(page)


def test_a_dead_link_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    page = tmp_path / "page.md"
    page.write_text("# A heading\n[ok](#a-heading) [gone](#nope) [file](missing.md)\n```\n[in code](x.md)\n```\n")
    assert dead_links(page) == ["page.md:2: (#nope): no heading for #nope in page.md",
                                "page.md:2: (missing.md): no file missing.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    assert not dead_links(page), "\n".join(dead_links(page))


def test_the_readme_is_a_guide_of_at_most_350_lines():
    """Issue 52: the README is a guide (first command before install details); reports live in docs/RESULTS.md."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 350
    assert text.index("make fit") < text.index("requirements/README.md")
    assert "docs/RESULTS.md" in text

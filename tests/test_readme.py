"""The README and the docs: their Python examples run and print what they say they print, the
README stays a front door, and every relative link (and its #anchor) leads somewhere."""

from __future__ import annotations

import doctest
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LMDB = Path("/tmp/readme-lmdb")  # the path serving.md's Engine example uses
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
MAX_README_LINES = 250  # a front door; the manual lives in docs/
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# a ratio, a share, a time, a size, a date or a decimal: what belongs in a benchmark table
MEASURE = re.compile(r"\d\s*(x|%|ms|s|GB|MB)\b|\d{4}-\d{2}-\d{2}|\d\.\d")


def python_blocks(text: str) -> str:
    """The ```python blocks of a page, as one doctest text (shared namespace)."""
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out, fence = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            out.add(slug(line.lstrip("#")))
    return out


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", [p for p in PAGES if ">>> " in p.read_text()], ids=page_id)
def test_the_examples_run(page: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # configs/default.yaml is read relative to the repo
    shutil.rmtree(README_LMDB, ignore_errors=True)  # an example starts from an empty L3
    test = doctest.DocTestParser().get_doctest(
        python_blocks(page.read_text()), {}, page.name, str(page), 0)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        runner.run(test)
    finally:
        shutil.rmtree(README_LMDB, ignore_errors=True)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


def test_the_pages_hold_the_examples() -> None:
    """The examples moved with the manual, none lost: the docs run more than 20 between
    them."""
    total = sum(len(doctest.DocTestParser().get_examples(python_blocks(p.read_text())))
                for p in PAGES)
    assert total > 20


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert "make test" in text and "make serve" in text  # CI runs the README's test command
    linked = {m.group(1).split("#")[0] for m in LINK.finditer(text)}
    for page in ("serving", "configuration", "tiers", "policies", "events", "integrations",
                 "benchmarks", "architecture", "development", "kernels"):
        assert f"docs/{page}.md" in linked, f"the README does not link docs/{page}.md"
    first_link = LINK.search(text.split("## ", 1)[0])  # before the first section
    assert first_link and first_link.group(1) == "docs/architecture.md", "architecture first"


def section(text: str, title: str) -> list[str]:
    """The lines of a page's `## title` section."""
    body = text.split(f"\n## {title}\n", 1)[1]
    return body.split("\n## ", 1)[0].splitlines()


def test_the_status_table_is_part_state_link() -> None:
    """Three columns: the part, its state in one word, and where its doc lives; nothing else
    (dates, numbers and caveats go to the benchmark tables and the caveat list)."""
    rows = [line for line in section(README.read_text(), "Status") if line.startswith("| ")]
    assert rows[0] == "| part | state | doc |"
    states = set()
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 3, row
        part, state, doc = cells
        states.add(state)
        assert state in ("done", "partial", "untested"), row
        assert LINK.search(doc) and not LINK.sub("", doc).strip(" ,"), row  # links only
        assert not MEASURE.search(part), f"a measurement in the status table: {row}"
    assert {"done", "partial", "untested"} <= states


def test_the_caveats_are_words() -> None:
    """Each caveat says what was not run or not met in its own words; its numbers are in the
    benchmark tables."""
    caveats = [line for line in section(README.read_text(), "Caveats") if line.strip()]
    assert sum(line.startswith("- ") for line in caveats) >= 10
    for line in caveats:
        assert not MEASURE.search(line), f"a measurement among the caveats: {line}"
    for admitted in ("side by side with vLLM on a GPU", "vLLM's CUDA build", "SGLang server"):
        assert admitted in " ".join(caveats), admitted


def test_one_page_per_subject() -> None:
    """The benchmark and event pages were merged: no second page beside either."""
    docs = ROOT / "docs"
    assert not (docs / "bench.md").exists() and not (docs / "kv_events.md").exists()


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    for match in LINK.finditer(page.read_text()):
        target = match.group(1)
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page_id(page)} links {target}: no such file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page_id(page)} links {target}: no such heading"

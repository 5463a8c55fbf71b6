"""The README's Python examples run and print what the README says they print."""

from __future__ import annotations

import doctest
import re
import shutil
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
README_LMDB = Path("/tmp/readme-lmdb")  # the path the README's example uses
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def python_blocks(text: str) -> str:
    """The ```python blocks of the README, as one doctest text (shared namespace)."""
    return "\n".join(re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL))


def test_readme_examples(monkeypatch) -> None:
    monkeypatch.chdir(README.parent)  # configs/default.yaml is read relative to the repo
    shutil.rmtree(README_LMDB, ignore_errors=True)  # the example starts from an empty L3
    test = doctest.DocTestParser().get_doctest(
        python_blocks(README.read_text()), {}, "README.md", str(README), 0)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    try:
        runner.run(test)
    finally:
        shutil.rmtree(README_LMDB, ignore_errors=True)
    result = runner.summarize(verbose=False)
    assert result.attempted > 20
    assert result.failed == 0

"""The documentation's runnable examples run (so the quick start cannot rot).

A fenced ```python block in README.md or docs/*.md whose last non-blank line before the fence
is `<!-- runnable -->` is runnable. The runnable blocks of one page run in order in one namespace (a page may build a
model in one block and train it in the next), in a fresh temporary directory, under the current
backend; a block that raises fails the test for its page (docs/design.md).
"""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- runnable -->"
PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT)
                              for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
# Pages that must keep at least one runnable block (a lost marker would pass silently).
WITH_EXAMPLES = ["README.md", "docs/masks.md", "docs/generation.md", "docs/saving.md",
                 "docs/language_models.md", "docs/pretrained.md", "docs/reliability.md",
                 "docs/scaling.md", "docs/design.md", "docs/text.md"]


def _read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)


def runnable_blocks(text):
    """The code of every ```python block marked runnable, in page order."""
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() == MARKER:
            blocks.append(match.group(1))
    return blocks


def run_page(blocks, name):
    """Run `blocks` in order in one fresh namespace; the traceback names the page and block."""
    namespace = {"__name__": "__docs__"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"{name}, runnable block {i}", "exec"), namespace)
    return namespace


def test_the_marker_selects_only_marked_python_blocks():
    text = ("text\n<!-- runnable -->\n```python\nx = 1\n```\n\n```python\nraise SystemExit\n```\n"
            "<!-- runnable -->\n```bash\nmake test\n```\n<!-- runnable -->\nprose\n```python\n"
            "y = 2\n```\n<!-- runnable -->\n\n```python\nz = x + 1\n```\n")
    assert runnable_blocks(text) == ["x = 1\n", "z = x + 1\n"]
    assert run_page(runnable_blocks(text), "t")["z"] == 2
    with pytest.raises(ZeroDivisionError):
        run_page(["a = 1", "1 / 0"], "t")


@pytest.mark.parametrize("page", WITH_EXAMPLES)
def test_page_keeps_runnable_examples(page):
    assert runnable_blocks(_read(page)), f"{page} has no block marked {MARKER!r}"


def test_sizes():
    assert len(_read("README.md")) <= 12_000
    assert len(_read("benchmarks/README.md").splitlines()) <= 200


@pytest.mark.parametrize("page", [p for p in PAGES if MARKER in _read(p)])
def test_runnable_blocks_run(page, tmp_path, monkeypatch):
    blocks = runnable_blocks(_read(page))
    monkeypatch.chdir(tmp_path)  # examples may write files (translator.keras, ...)
    import keras

    keras.utils.set_random_seed(0)
    run_page(blocks, page)

"""Every code block in docs/*.md runs, and docs/algorithms.md is the generated table.

Conventions for doc authors:

* ```` ```python ```` blocks run in order, each in a fresh namespace (a reader copies one block, so each block makes
  its own imports), with one fresh temporary folder per document as the working directory: files written by earlier
  blocks are there (in this process: imports are paid once; the algorithm registry, ``sys.path`` and modules loaded
  from the folder are restored afterwards).
* ```` ```bash ```` blocks run in ``bash -euo pipefail`` in the same folder, as a user would type them.
* ```` ```python file=NAME ```` and ```` ```yaml file=NAME ```` blocks are written to ``NAME`` in that folder
  (for later blocks to import or pass as ``--config``), not executed.
* ```` ```text ```` blocks are example output and are not run.
* A block preceded by ``<!-- not-run: REASON -->`` is skipped; the reason must say why it cannot run here.

Regenerate docs/algorithms.md after registering an algorithm: ``python tests/test_docs.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```([A-Za-z]*)([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not-run:\s*(.*?)\s*-->\s*$", re.S)
BEGIN, END = "<!-- BEGIN GENERATED: fedlight.config.catalog.algorithm_table_markdown() -->", "<!-- END GENERATED -->"
RUNNABLE = ("python", "bash")
BASH_TIMEOUT_S = 120


@dataclass
class Block:
    doc: str
    line: int
    lang: str
    file: str | None
    code: str
    skip: str | None

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} ({self.lang}{' file=' + self.file if self.file else ''})"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        attrs = dict(a.split("=", 1) for a in m.group(2).split() if "=" in a)
        before = text[: m.start()].rstrip("\n")
        last = before.rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(last)
        out.append(Block(path.name, text.count("\n", 0, m.start()) + 1, m.group(1), attrs.get("file"), m.group(3),
                         skip.group(1) if skip else None))
    return out


def doc_paths() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def runnable_docs() -> list[str]:
    return [p.name for p in doc_paths() if any(b.lang in RUNNABLE or b.file for b in blocks(p))]


# ------------------------------------------------------------------------------------------------ structure
def test_docs_exist_and_are_indexed():
    names = {p.name for p in doc_paths()}
    assert {"adding_an_algorithm.md", "bring_your_own_data.md", "multi_gpu.md", "reproducing_tables.md",
            "algorithms.md", "README.md"} <= names
    index = (DOCS / "README.md").read_text()
    for name in names - {"README.md"}:
        assert f"({name})" in index, f"docs/README.md does not link {name}"


def test_every_block_runs_or_says_why_not():
    seen = 0
    for path in doc_paths():
        for b in blocks(path):
            seen += 1
            if b.skip is not None:
                assert len(b.skip) >= 20, f"{b}: say why the block cannot run here"
                continue
            if b.file:
                assert b.lang in ("python", "yaml", "text", "json", "bash"), f"{b}: unexpected file block"
                continue
            assert b.lang in (*RUNNABLE, "text"), f"{b}: `{b.lang}` blocks cannot run; use python/bash, file=NAME, " \
                                                  "text (output) or a not-run comment"
    assert seen > 10


def test_links_between_docs_resolve():
    for path in doc_paths():
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).is_file(), f"{path.name} links to missing {target}"


# ------------------------------------------------------------------------------------------------ the table
def render_algorithm_table(current: str) -> str:
    from fedlight.config.catalog import algorithm_table_markdown

    head, rest = current.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{algorithm_table_markdown()}{END}{tail}"


def test_algorithm_table_is_generated():
    path = DOCS / "algorithms.md"
    text = path.read_text()
    assert BEGIN in text and END in text
    assert text == render_algorithm_table(text), "docs/algorithms.md is stale; regenerate: python tests/test_docs.py"


# ------------------------------------------------------------------------------------------------ running blocks
@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A working folder on sys.path; registry, sys.path and modules imported from the folder restored after."""
    from fedlight.core import registry
    saved_registry = dict(registry._REGISTRY)
    saved_path = list(sys.path)
    before = set(sys.modules)
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved_registry)
        sys.path[:] = saved_path
        for name in set(sys.modules) - before:
            f = getattr(sys.modules[name], "__file__", None) or ""
            if f.startswith(str(tmp_path)):
                del sys.modules[name]


def _bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=BASH_TIMEOUT_S)
    assert res.returncode == 0, f"{block} failed ({res.returncode}):\n{block.code}\n--- stdout\n{res.stdout[-3000:]}" \
                                f"\n--- stderr\n{res.stderr[-3000:]}"


@pytest.mark.parametrize("doc", runnable_docs())
def test_doc_code_runs(doc, sandbox):
    for b in blocks(DOCS / doc):
        if b.skip is not None:
            continue
        if b.file:
            (sandbox / b.file).parent.mkdir(parents=True, exist_ok=True)
            (sandbox / b.file).write_text(b.code)
        elif b.lang == "python":
            try:
                exec(compile(b.code, str(b), "exec"), {"__name__": "__main__"})  # standalone: no names from above
            except Exception as e:
                raise AssertionError(f"{b} raised {type(e).__name__}: {e}\n{b.code}") from e
        elif b.lang == "bash":
            _bash(b, sandbox)


if __name__ == "__main__":  # regenerate docs/algorithms.md
    path = DOCS / "algorithms.md"
    path.write_text(render_algorithm_table(path.read_text()))
    print(f"wrote {path}")

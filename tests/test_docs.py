"""Every code block in docs/ (docs/*.md and its folders) runs, docs/algorithms.md is the generated table, and the
user pages (all but docs/contributing/) cite no issue numbers or dated diaries.

Conventions for doc authors:

* ```` ```python ```` blocks run in order, each in a fresh namespace (a reader copies one block, so each block makes
  its own imports), with one fresh temporary folder per document as the working directory: files written by earlier
  blocks are there (in this process: imports are paid once; the algorithm registry, ``sys.path`` and modules loaded
  from the folder are restored afterwards).
* ```` ```bash ```` blocks run in ``bash -euo pipefail`` in the same folder, as a user would type them; a block of
  plain ``fedlight`` commands (each maybe after ``NAME=value`` words, or ``export NAME=value`` lines; no expansion,
  pipe or redirection) runs the same commands in this process, through ``fedlight.config.cli.main`` (the
  ``fedlight`` program's function), after bash has checked its syntax and found ``fedlight`` on its ``PATH``: an
  interpreter start saved per command. A command that starts processes of its own (``--devices``) runs in bash.
* ```` ```python file=NAME ```` and ```` ```yaml file=NAME ```` blocks are written to ``NAME`` in that folder
  (for later blocks to import or pass as ``--config``), not executed.
* ```` ```text ```` blocks are example output and are not run.
* A block preceded by ``<!-- not-run: REASON -->`` is skipped; the reason must say why it cannot run here.
* ```` ```{directive} ```` blocks (MyST directives of the documentation site, e.g. ``{eval-rst}``) are not code.

Regenerate docs/algorithms.md after registering an algorithm: ``python tests/test_docs.py``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
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
        if not m.group(1) and m.group(2).strip().startswith("{"):  # a directive of the site, e.g. {eval-rst}
            continue
        attrs = dict(a.split("=", 1) for a in m.group(2).split() if "=" in a)
        before = text[: m.start()].rstrip("\n")
        last = before.rsplit("\n", 1)[-1]
        skip = NOT_RUN.search(last)
        out.append(Block(doc_name(path), text.count("\n", 0, m.start()) + 1, m.group(1), attrs.get("file"), m.group(3),
                         skip.group(1) if skip else None))
    return out


def doc_name(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


def doc_paths() -> list[Path]:
    """Every page under docs/ (the site's own folders, ``_ext`` and ``_build``, left out)."""
    return sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))


def user_pages() -> list[Path]:
    """The pages a user reads: all but docs/contributing/ (how fedlight itself is worked on)."""
    return [p for p in doc_paths() if p.relative_to(DOCS).parts[0] != "contributing"]


def runnable_docs() -> list[str]:
    return [doc_name(p) for p in doc_paths() if any(b.lang in RUNNABLE or b.file for b in blocks(p))]


# ------------------------------------------------------------------------------------------------ structure
def test_docs_exist_and_are_indexed():
    names = {doc_name(p) for p in doc_paths()}
    assert {"adding_an_algorithm.md", "bring_your_own_data.md", "multi_gpu.md", "reproducing_tables.md",
            "algorithms.md", "README.md", "index.md", "glossary.md", "contributing/index.md"} <= names
    index = (DOCS / "README.md").read_text()  # the folder's page on a code host: every top-level page
    for name in {n for n in names if "/" not in n} - {"README.md"}:
        assert f"({name})" in index, f"docs/README.md does not link {name}"


ISSUE = re.compile(r"\bissues? (?:#?\d+)|(?<![\w&/`])#\d+\b|\b20\d\d-[01]\d-[0-3]\d\b", re.I)
"""An issue number (``issue 42``, ``#42``) or a date (``2026-11-28``): a work diary, not a user's page."""


def test_user_pages_cite_no_issue_numbers_or_dates():
    found = [f"{doc_name(p)}:{p.read_text().count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
             for p in user_pages() for m in ISSUE.finditer(p.read_text())]
    assert not found, "user pages speak to users (issue numbers, dated timings and work plans go to " \
                      "docs/contributing/ or results/):\n" + "\n".join(found)


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
            assert (path.parent / target).is_file(), f"{doc_name(path)} links to missing {target}"


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
    from fedtest import imports_restored

    with imports_restored(tmp_path):
        monkeypatch.chdir(tmp_path)
        sys.path.insert(0, str(tmp_path))
        yield tmp_path


def _bash_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _bash(block: Block, cwd: Path) -> None:
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=_bash_env(),
                         capture_output=True, text=True, timeout=BASH_TIMEOUT_S)
    assert res.returncode == 0, f"{block} failed ({res.returncode}):\n{block.code}\n--- stdout\n{res.stdout[-3000:]}" \
                                f"\n--- stderr\n{res.stderr[-3000:]}"


PLAIN = re.compile(r"[A-Za-z0-9_./:=,+@%-]*")  # the words bash leaves as they are (outside quotes)
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)


def fedlight_commands(block: Block) -> list[tuple[str, dict[str, str], list[str]]] | None:
    """``(kind, env, argv)`` per command of a block made only of ``[NAME=value ...] fedlight ARGS`` lines (kind
    ``fedlight``) and ``export NAME=value`` lines (kind ``export``), with nothing bash would expand, glob or redirect
    (quoted text without ``$``, ``\\`` or a backquote is fine) and no ``--devices``; None for any other block."""
    out = []
    for line in block.code.splitlines():
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        bare = re.sub(r"'[^']*'|\"[^\"$`\\]*\"", "", code)  # the text outside quotes
        if not all(PLAIN.fullmatch(w) for w in bare.split()):
            return None
        words = shlex.split(code)
        if not words:
            continue
        if words[0] == "export" and len(words) > 1 and all(ASSIGNMENT.fullmatch(w) for w in words[1:]):
            out.append(("export", dict(w.split("=", 1) for w in words[1:]), []))
            continue
        env = {}
        while words and ASSIGNMENT.fullmatch(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if not words or words[0] != "fedlight" or any(w.startswith("--devices") for w in words):
            return None
        out.append(("fedlight", env, words[1:]))
    return out or None


def _in_process(block: Block, commands: list, monkeypatch) -> None:
    """The block's ``fedlight`` commands through the program's function, in this process (see the module)."""
    from fedlight.config.cli import main

    env = _bash_env()
    syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, f"{block}: bash refuses its syntax: {syntax.stderr}"
    assert shutil.which("fedlight", path=env["PATH"]), f"{block}: no `fedlight` on bash's PATH"
    with monkeypatch.context() as block_env:
        block_env.setenv("OMP_NUM_THREADS", env["OMP_NUM_THREADS"])
        for kind, assigned, argv in commands:
            if kind == "export":
                for name, value in assigned.items():
                    block_env.setenv(name, value)
                continue
            with monkeypatch.context() as line_env:
                for name, value in assigned.items():
                    line_env.setenv(name, value)
                # what the program would import from: the folder only where PYTHONPATH names it, as for bash's
                pythonpath = [str(Path(d).resolve()) for d in os.environ.get("PYTHONPATH", "").split(os.pathsep) if d]
                line_env.setattr(sys, "path", [*pythonpath, *(d for d in sys.path if d != str(Path.cwd()))])
                rc = main(argv)
            assert rc == 0, f"{block} failed ({rc}) at `fedlight {shlex.join(argv)}`:\n{block.code}"


@pytest.mark.parametrize("doc", runnable_docs())
def test_doc_code_runs(doc, sandbox, monkeypatch):
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
            commands = fedlight_commands(b)
            if commands:
                _in_process(b, commands, monkeypatch)
            else:
                _bash(b, sandbox)


if __name__ == "__main__":  # regenerate docs/algorithms.md
    path = DOCS / "algorithms.md"
    path.write_text(render_algorithm_table(path.read_text()))
    print(f"wrote {path}")

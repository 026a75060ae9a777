"""The README stays true: every ``fedlight`` command in its code blocks runs (shrunk) and exits 0, its Fabric
snippet runs, its algorithm table is the registry's, its first two commands are the ones CI runs.

The commands are read from the README when the tests are collected (any fenced ``bash``/``sh``/``shell``/``console``
block; ``$ `` prompts, ``\\`` continuations, ``&&``/``;`` chains, ``NAME=value`` prefixes and ``#`` comments are
understood). Each runs in order, in one scratch folder that links ``recipes/``, with flags appended that shrink it to
seconds (:func:`shrink`): one round of two clients taking two local steps, a small test set, a folder of its own.
A command that needs what a test machine cannot have is named in :data:`CANNOT_RUN_HERE` with the reason; any other
command that fails fails here. The ``fedlight fit --config recipes/...`` commands of docs/ that tests/test_docs.py
cannot run (its scratch folder holds no ``recipes/``) run here the same way.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from fedlight.config import catalog

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```([A-Za-z]*)[^\n`]*\n(.*?)^```[ \t]*$", re.S | re.M)
SHELL = ("bash", "sh", "shell", "console", "zsh", "")
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*", re.S)

CANNOT_RUN_HERE = {  # a regular expression over the command as written -> why the suite cannot run it
    r"--launcher slurm": "submits Slurm jobs: needs a Slurm cluster (tests/test_reproduce_real_slurm.py runs a table "
                         "through a single-node Slurm)",
    r"^fedlight reproduce \S+ .*--table-only": "tabulates the runs the Slurm command made (with none it refuses, exit "
                                              "2); tests/test_reproduce.py rebuilds tables from finished runs",
    r"^fedlight tune ": "an Optuna study of tens of 100-round Fashion-MNIST trials; tests/test_tune.py runs the same "
                       "command on a spec of four tiny trials",
    r"--tuned ": "reads the study of the `fedlight tune` command (tests/test_tune.py runs --tuned on a tiny study)",
    r"my_pkg\.": "`my_pkg` stands for the reader's own package; docs/lightning.md runs complete modules this way",
    r"recipes/fednsam_resnet18\.yaml": "CIFAR-100's files are not in the suite's data folder (no network to download "
                                        "them); tests/test_recipes.py instantiates the recipe",
    r"--accelerator (cuda|gpu)|--precision bf16": "needs a CUDA GPU (it runs where the suite has one)",
}


def test_fabric_snippet_is_the_docs_and_runs():
    """The README's Fabric snippet is docs/fabric.md's first block (tests/test_fabric.py runs that block for every
    registered rule and checks the output the page shows); here it runs as the README shows it."""
    def first_python(text: str) -> str:
        return re.search(r"```python\n(.*?)```", text, re.S).group(1)

    code = first_python(README.read_text().split("## Use a rule in your own Fabric script", 1)[1])
    assert code == first_python((ROOT / "docs" / "fabric.md").read_text())
    scope: dict = {}
    exec(compile(code, "README-snippet", "exec"), scope)
    assert all(torch.isfinite(v).all() for v in scope["x"].values())
    assert any(not torch.equal(scope["x"][k], scope["trainer"].x0[k]) for k in scope["x"])  # the rounds moved it


def test_algorithm_table_is_generated():
    text = README.read_text()
    assert catalog.readme_with_table(text) == text, "run `python -m fedlight.config.catalog` to refresh the README"


def test_fresh_machine_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].strip() == 'pip install -e ".[dev]" && fedlight fit --config recipes/quickstart.yaml'
    assert blocks[1].strip() == "FEDLIGHT_DATA=../shared/data python -m pytest tests -q"
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert blocks[0].strip() in ci and blocks[1].strip() in ci, "CI runs the README's two commands as written"


def test_the_readme_install_brings_every_optional_package_the_tests_use():
    """A fresh machine that runs the README's two commands runs the whole suite: `dev` installs every optional extra's
    packages (named directly or through `fedlight[extra,...]`), except `datasets`, which only online GLUE loading uses
    (the tests read GLUE from local files), and `pfl`, which pins packages of its own and so runs in a venv of its own
    (`fedlight bench --peers --pfl-python`; the smoke test skips its side, saying so). An extra added without adding
    it to dev fails here, not on a user."""
    import tomllib

    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(reqs):
        out = set()
        for r in reqs:
            name, rest = re.match(r"([A-Za-z0-9_.-]+)(\[([^\]]*)\])?", r).group(1, 3)
            if name == "fedlight":
                for extra in rest.split(","):
                    out |= names(extras[extra.strip()])
            else:
                out.add(name.lower())
        return out

    dev = names(extras["dev"])
    missing = {e: sorted(names(reqs) - dev - {"datasets", "pfl"}) for e, reqs in extras.items() if e != "dev"}
    assert not {e: m for e, m in missing.items() if m}, f"add to the dev extra in pyproject.toml: {missing}"


def test_readme_and_docs_stay_inside_the_repository():
    """Links resolve inside the repository; nothing points at files a clone does not have (../shared/...)."""
    root = README.parent
    for page in [README, *sorted((root / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            resolved = (page.parent / target).resolve()
            assert resolved.exists(), f"{page.name} links to missing {target}"
            assert root.resolve() in resolved.parents or resolved == root.resolve(), f"{page.name}: {target} is outside"
        outside = [ln for ln in text.splitlines() if "../shared/" in ln and "FEDLIGHT_DATA=../shared/data" not in ln]
        assert not outside, f"{page.name} refers to files outside the repository: {outside}"


def test_readme_states_a_measured_suite_time():
    assert "TEST_SUITE_SIZE_AND_TIME" not in README.read_text(), "measure the suite and write its size and time"


# ------------------------------------------------------------------------------------------------ every command
def commands(text: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """``(as written, env, argv after "fedlight")`` for every ``fedlight`` command in the shell blocks of ``text``."""
    out = []
    for m in FENCE.finditer(text):
        if m.group(1) not in SHELL:
            continue
        body = m.group(2).replace("\\\n", " ")
        lines = body.splitlines()
        if m.group(1) == "console" or any(ln.startswith("$ ") for ln in lines):  # prompts: the rest is output
            lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
        for line in lines:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words, part = list(lexer), []
            for w in [*words, ";"]:
                if w not in ("&&", "||", ";", "|", "&"):
                    part.append(w)
                    continue
                env = {}
                while part and ASSIGNMENT.fullmatch(part[0]):
                    name, value = part.pop(0).split("=", 1)
                    env[name] = value
                if len(part) > 1 and part[0] == "fedlight":
                    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), shlex.join(part)])
                    out.append((shown, env, part[1:]))
                part = []
    return out


GPU = r"--accelerator (cuda|gpu)|--precision bf16"


def cannot_run_here(shown: str) -> str | None:
    """Why ``shown`` cannot run here (``None``: it runs); a GPU command runs where there is one."""
    found = [(p, why) for p, why in CANNOT_RUN_HERE.items() if re.search(p, shown)]
    return next((why for p, why in found if p != GPU or not torch.cuda.is_available()), None)


def _data_params(argv: list[str]) -> set[str]:
    """The constructor arguments of the data module a ``fit`` command trains on (its recipe's, or ``--data``'s)."""
    from fedlight.lab.tables.spec import _init_params

    path = argv[argv.index("--config") + 1] if "--config" in argv else None
    data = (yaml.safe_load(Path(path).read_text()) or {}).get("data") or {} if path else {}
    class_path = argv[argv.index("--data") + 1] if "--data" in argv else (data.get("class_path") or "")
    module, _, name = class_path.rpartition(".")
    return _init_params(getattr(__import__(module, fromlist=[name]), name)) if module else set()


def shrink(argv: list[str], folder: Path) -> list[str]:
    """The command with the flags that make it seconds long and write under ``folder`` (appended: they win)."""
    sub = argv[0]
    if sub in ("fit", "lockstep"):
        flags = ["--loop.rounds", "1", "--loop.local_epochs", "null", "--loop.local_steps", "2",
                 "--loop.clients_per_round", "2", "--loop.progress", "false"]
        if "test_subset" in _data_params(argv):
            flags += ["--data.init_args.test_subset", "200"]
        return [*argv, *flags, *(["--out_dir", str(folder)] if sub == "fit" else [])]
    if sub in ("reproduce", "tune"):
        return [*argv, "--out", str(folder)]
    return list(argv)


README_COMMANDS = commands(README.read_text())


def test_the_readme_shows_fedlight_commands():
    shown = [c[0] for c in README_COMMANDS]
    assert len(shown) >= 3 and shown[0] == "fedlight fit --config recipes/quickstart.yaml", shown
    assert all(len(why) >= 30 for why in CANNOT_RUN_HERE.values())


def test_commands_are_read_as_a_shell_reads_them():
    text = (
        "```bash\n"
        "pip install -e \".[dev]\" && fedlight fit --config q.yaml   # a comment\n"
        "PYTHONPATH=. fedlight fit --model a.B \\\n    --loggers \"[tensorboard, mlflow]\"\n"
        "tensorboard --logdir runs/\n```\n"
        "```console\n$ fedlight ls\nfedlight: run directory runs/x\n```\n"
        "```python\nfedlight fit\n```\n"
    )
    assert commands(text) == [
        ("fedlight fit --config q.yaml", {}, ["fit", "--config", "q.yaml"]),
        ("PYTHONPATH=. fedlight fit --model a.B --loggers '[tensorboard, mlflow]'", {"PYTHONPATH": "."},
         ["fit", "--model", "a.B", "--loggers", "[tensorboard, mlflow]"]),
        ("fedlight ls", {}, ["ls"]),
    ]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One folder for the README's commands, in order (a later one may read what an earlier one wrote)."""
    folder = tmp_path_factory.mktemp("readme")
    (folder / "recipes").symlink_to(ROOT / "recipes")
    return folder


def _docs_recipe_commands() -> list[tuple[str, str, dict[str, str], list[str]]]:
    """``(where, as written, env, argv)`` of the ``fedlight fit --config recipes/...`` commands in docs/ blocks that
    tests/test_docs.py does not run (its scratch folder holds no ``recipes/``; marked not-run there)."""
    from test_docs import blocks, doc_paths

    return [(f"{path.name}:{b.line}", *c) for path in doc_paths() for b in blocks(path)
            if b.skip is not None and b.lang in SHELL for c in commands(f"```bash\n{b.code}```\n")
            if c[2][0] == "fit" and "recipes/" in c[0]]


DOCS_COMMANDS = _docs_recipe_commands()


@pytest.mark.parametrize("index", range(len(DOCS_COMMANDS)), ids=[f"{c[0]} {c[1][:60]}" for c in DOCS_COMMANDS])
def test_docs_recipe_command_runs(index, scratch, monkeypatch):
    _, shown, env, argv = DOCS_COMMANDS[index]
    _run(shown, env, argv, scratch / f"docs{index}", scratch, monkeypatch)


@pytest.mark.parametrize("index", range(len(README_COMMANDS)), ids=[c[0][:80] for c in README_COMMANDS])
def test_readme_command_runs(index, scratch, monkeypatch):
    shown, env, argv = README_COMMANDS[index]
    _run(shown, env, argv, scratch / f"cmd{index}", scratch, monkeypatch)


def _run(shown: str, env: dict[str, str], argv: list[str], folder: Path, scratch: Path, monkeypatch) -> None:
    """Run a command as written, shrunk to write under ``folder``, from ``scratch``; it must exit 0."""
    why = cannot_run_here(shown)
    if why is not None:
        pytest.skip(why)
    if os.environ.get("FEDLIGHT_DATA"):  # the data folder as the suite found it, from the scratch folder too
        monkeypatch.setenv("FEDLIGHT_DATA", str(Path(os.environ["FEDLIGHT_DATA"]).resolve()))
    argv = shrink(argv, folder)
    monkeypatch.chdir(scratch)
    for name in [k for k in os.environ if k.startswith("MLFLOW_")]:  # the README's commands need no set-up
        monkeypatch.delenv(name)
    if any(a.startswith("--devices") for a in argv):  # starts processes of its own: as a user runs it
        run_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        res = subprocess.run([sys.executable, "-m", "fedlight", *argv], cwd=scratch, env=run_env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, f"`{shown}` shrunk to `fedlight {shlex.join(argv)}`:\n{res.stderr[-3000:]}"
        return
    from fedlight.config.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        status = main(argv)
    except SystemExit as e:  # --print_config, --help: the parser prints and exits
        status = e.code or 0
    assert status == 0, f"`{shown}` shrunk to `fedlight {shlex.join(argv)}` failed"

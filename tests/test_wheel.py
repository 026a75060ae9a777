"""fedlight as a user installs it: the sdist and the wheel built offline from a copy of the sources, ``twine check``
on both, the wheel installed alone (``--no-deps``) into a fresh venv that reuses this environment's packages, and
the commands a user runs from an empty directory: ``--version``, ``ls``, the quickstart by name, a table spec by
name (``--dry-run``), ``cp``. The venv's fedlight is the wheel's, not this checkout (no PYTHONPATH, checked)."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import fedlight
from fedlight.config import cli

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE", "fedlight", "recipes")
RECIPES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "recipes").rglob("*.yaml"))


def _run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)
    assert res.returncode == 0, f"{cmd}: {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """The sdist and the wheel, built offline (``--no-isolation``: this environment's setuptools) from a copy of the
    sources (the build writes build/ and *.egg-info next to them); the wheel is built from the sdist, so a file the
    sdist leaves out is missing from the wheel too."""
    pytest.importorskip("build", reason="the dev extra's `build` builds the distributions")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / name, src / name)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(src)])
    return tmp / "dist"


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory):
    """A fresh venv seeing this environment's packages (no download); the wheel installed into it with --no-deps."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)])
    python = root / "bin" / "python"
    wheel = next(dist.glob("*.whl"))
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation", "--quiet",
          str(wheel)], env=_env())
    return root


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return env | {"OMP_NUM_THREADS": "1"}


def test_the_wheel_carries_the_package_and_its_recipes_and_nothing_else(dist):
    wheel = next(dist.glob("*.whl"))
    assert wheel.name == f"fedlight-{fedlight.__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    info = f"fedlight-{fedlight.__version__}.dist-info/"
    assert all(n.startswith(("fedlight/", info)) for n in names), [n for n in names if not n.startswith("fedlight/")]
    assert sorted(n.removeprefix("fedlight/") for n in names if n.endswith(".yaml")) == RECIPES
    assert "fedlight/recipes/README.md" in names and f"{info}licenses/LICENSE" in names
    assert not [n for n in names if n.split("/")[0] in ("tests", "results", "tools") or "/tests/" in n]
    sdist = next(dist.glob("*.tar.gz"))
    import tarfile

    members = [m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m]
    assert set(RECIPES) <= set(members) and "LICENSE" in members and "setup.py" in members
    assert not [m for m in members if m.split("/")[0] in ("tests", "results", "tools")]


def test_twine_check_passes(dist):
    pytest.importorskip("twine", reason="the dev extra's `twine` checks the distributions")
    res = _run([sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(dist.iterdir()))])
    assert res.stdout.count("PASSED") == 2, res.stdout


def test_an_installed_wheel_runs_from_an_empty_directory(venv, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    bin_ = venv / "bin"

    def fedlight_(*args, ok=True):
        res = subprocess.run([str(bin_ / "fedlight"), *args], cwd=empty, env=_env(), capture_output=True, text=True,
                             timeout=300)
        assert (res.returncode == 0) == ok, f"fedlight {' '.join(args)}: {res.returncode}\n{res.stderr[-3000:]}"
        return res

    where = _run([str(bin_ / "python"), "-c", "import fedlight; print(fedlight.__file__)"], cwd=empty, env=_env())
    package = Path(where.stdout.strip()).parent
    assert package.is_relative_to(venv), package  # the wheel's fedlight, not this checkout's
    installed = package / "recipes"
    assert fedlight_("--version").stdout == f"fedlight {fedlight.__version__}\n"
    listed = fedlight_("ls", "recipes").stdout
    assert "\nquickstart " in listed and "FedWMSAM (NeurIPS'25) Table 1 — paper: 84.64% (500 rounds)" in listed
    assert "\nfednsam_table2 " in fedlight_("ls", "tables").stdout

    # the quickstart by name, two rounds: what this checkout computes in this process
    fedlight_("fit", "--config", "quickstart", "--loop.rounds", "2", "--out_dir", "run")
    summary = json.loads((empty / "run" / "summary.json").read_text())
    assert summary["rounds_completed"] == 2 and summary["versions"]["fedlight"] == fedlight.__version__
    assert summary["versions"]["git_revision"] is None  # an installed wheel has no checkout
    monkeypatch.chdir(tmp_path)
    assert cli.main(["fit", "--config", str(ROOT / "recipes" / "quickstart.yaml"), "--loop.rounds", "2",
                     "--out_dir", str(tmp_path / "here")]) == 0
    here = json.loads((tmp_path / "here" / "summary.json").read_text())
    assert summary["final_test_acc"] == here["final_test_acc"] and summary["final_test_acc"] > 0.1
    # the repository path works too, from anywhere
    printed = fedlight_("fit", "--config", "recipes/quickstart.yaml", "--print_config").stdout
    assert "fedlight.data.Synthetic" in printed and "rounds: 40" in printed

    # a table spec by name: its base recipe is the installed one
    dry = fedlight_("reproduce", "fednsam_table2", "--dry-run", "--cells", "fedavg/*", "--out", "t").stdout.splitlines()
    assert dry and all(f"--config {installed / 'fednsam_resnet18.yaml'} " in line for line in dry), dry[:2]

    # cp: out to edit, never over an existing file; the copied spec still finds its base recipe
    assert fedlight_("cp", "quickstart", ".").returncode == 0
    assert (empty / "quickstart.yaml").read_bytes() == (installed / "quickstart.yaml").read_bytes()
    refused = fedlight_("cp", "quickstart", ".", ok=False)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "exists; not overwritten" in refused.stderr
    fedlight_("cp", "fednsam_table2", "mine.yaml")
    mine = fedlight_("reproduce", "mine.yaml", "--dry-run", "--cells", "fedavg/*", "--out", "t").stdout
    assert mine.splitlines() == dry

    missing = fedlight_("fit", "--config", "quickstrat", ok=False)
    assert missing.returncode == 2 and "closest bundled: quickstart" in missing.stderr
    assert str(installed) in missing.stderr and missing.stderr.count("\n") == 1

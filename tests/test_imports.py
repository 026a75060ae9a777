"""The package's face is light: a rule lifted into a custom Fabric script imports only the contract."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("fedlight.data", "fedlight.models", "fedlight.config.cli", "fedlight.lab", "fedlight.config.api",
         "fedlight.engine.loop", "fedlight.cli", "fedlight.api", "fedlight.loop", "lightning", "jsonargparse",
         "torchvision", "submitit")


def _imported(statement: str) -> list[str]:
    """The heavy modules loaded by ``statement`` in a fresh interpreter that imports this checkout's fedlight."""
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mods = json.loads(out.strip().splitlines()[-1])
    assert "fedlight" in mods
    return [m for m in mods if any(m == h or m.startswith(h + ".") for h in HEAVY)]


@pytest.mark.parametrize("statement", ["import fedlight.rules", "import fedlight.algorithms.fedsam", "import fedlight",
                                       "from fedlight.algorithms import FedAdamW", "import fedlight.registry"])
def test_rule_imports_no_data_models_cli_or_lab(statement):
    assert _imported(statement) == []


NLP = ("transformers", "peft", "datasets", "tokenizers")


def test_the_nlp_extra_is_imported_only_when_used():
    statement = ("import fedlight, fedlight.data, fedlight.models, fedlight.tasks, fedlight.algorithms\n"
                 "from fedlight.data import GLUE, Shakespeare\nfrom fedlight.models import MODELS")
    code = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    mods = json.loads(out.strip().splitlines()[-1])
    assert [m for m in mods if m.split(".")[0] in NLP] == []


def test_old_import_paths_are_the_moved_modules():
    """``fedlight.rules``, ``fedlight.loop``, ``fedlight.cli`` ... (the paths before core/ engine/ config/) import
    the very modules of their new homes, and no file is left at an old path."""
    import importlib

    from fedlight._moved import MOVED

    for old, new in MOVED.items():
        assert importlib.import_module(f"fedlight.{old}") is importlib.import_module(f"fedlight.{new}"), old
        assert not (ROOT / "fedlight" / f"{old}.py").exists(), old
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "fedlight.cli", "ls", "tasks"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=env)
    assert res.returncode == 0 and "Regression" in res.stdout, res.stderr[-2000:]


def test_fit_is_still_importable_from_the_package():
    import fedlight
    from fedlight import fit
    from fedlight.config.api import fit as api_fit

    assert fit is api_fit and fedlight.fit is api_fit and "fit" in dir(fedlight)
    with pytest.raises(AttributeError):
        fedlight.no_such_name  # noqa: B018

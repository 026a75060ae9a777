"""Rules from outside fedlight by name: `--algorithm my_module:MyRule` (or `my_module.MyRule`) from the working
directory, and installed packages' `@register` names through the `fedlight.algorithms` entry-point group (a real
distribution's metadata on sys.path, found by importlib.metadata)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import fedlight
from fedlight.config.cli import main
from fedlight.errors import ConfigError

RULE = '''
import fedlight
from fedlight.core import params as P


class HalfClient(fedlight.LocalUpdateRule):
    def finish(self, model, ctx):
        result = super().finish(model, ctx)
        result.delta = P.scale(result.delta, 0.5)
        return result


@fedlight.register("{name}", paper="a lab's rule")
class {cls}(fedlight.Algorithm):
    """Half a FedAvg step.

    Args:
        knob: an argument, to show it reaches the class.
    """

    def __init__(self, knob: float = 0.5) -> None:
        self.knob = knob
        super().__init__(HalfClient(), fedlight.ServerRule())
'''
TINY = ["--model", "fedlight.models.MLP", "--model.in_features", "60", "--model.hidden", "[8]", "--data",
        "fedlight.data.Synthetic", "--data.num_clients", "4", "--data.samples_per_client", "20", "--loop.rounds", "1",
        "--loop.clients_per_round", "2", "--loop.local_steps", "2", "--loop.progress", "false", "--loggers", "none"]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """A working directory NOT on sys.path; registry, sys.path and modules loaded from tmp_path restored after."""
    from fedtest import imports_restored

    with imports_restored(tmp_path):
        work = tmp_path / "work"
        work.mkdir()
        monkeypatch.chdir(work)
        sys.path[:] = [p for p in sys.path if p not in ("", str(work))]
        yield tmp_path


def _fit(out: Path, algorithm: list[str], capsys) -> tuple[int, str]:
    rc = main(["fit", *TINY, "--out_dir", str(out), *algorithm])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("form", ["lab_rule:Half", "lab_rule.Half", "lab_rule:lab_half"])
def test_a_rule_in_the_working_directory_by_class_path(form, isolated, capsys):
    (Path.cwd() / "lab_rule.py").write_text(RULE.format(name="lab_half", cls="Half"))
    with pytest.raises(ModuleNotFoundError):
        __import__("lab_rule")  # not importable the ordinary way: the working directory is not on sys.path
    rc, err = _fit(Path("runs/a"), ["--algorithm", form, "--algorithm.knob", "0.25"], capsys)
    assert rc == 0, err
    recorded = yaml.safe_load(Path("runs/a/config.yaml").read_text())["algorithm"]
    assert recorded == {"class_path": "lab_rule.Half", "init_args": {"knob": 0.25}}
    assert sys.path[-1] == os.getcwd()  # kept at the end, where it shadows nothing


def test_python_api_takes_the_class_path_too(isolated):
    (Path.cwd() / "lab_rule2.py").write_text(RULE.format(name="lab_half2", cls="Half2"))
    algo = fedlight.create("lab_rule2:Half2", knob=0.1)
    assert type(algo).__name__ == "Half2" and algo.knob == 0.1
    assert fedlight.get_algorithm("LAB-HALF2").cls is type(algo)  # registered on import, any letter case


def test_unknown_names_say_how_to_name_a_rule_of_your_own(isolated, capsys):
    with pytest.raises(ConfigError, match=r"did you mean 'fedsam'.*`my_module:MyRule`"):
        fedlight.get_algorithm("fedsma")
    rc, err = _fit(Path("runs/b"), ["--algorithm", "nomodule:Rule"], capsys)
    assert rc == 2
    assert "cannot import 'nomodule'" in err and "my_module:MyRule" in err and len(err.strip().splitlines()) == 1
    (Path.cwd() / "lab_rule3.py").write_text(RULE.format(name="lab_half3", cls="Half3"))
    rc, err = _fit(Path("runs/c"), ["--algorithm", "lab_rule3:Halff"], capsys)
    assert rc == 2 and "module 'lab_rule3' has no class 'Halff'; did you mean 'lab_rule3:Half3'?" in err


def _distribution(site: Path, package: str, entry_points: str, code: str) -> None:
    """An installed distribution as pip leaves it: the package and its .dist-info with entry_points.txt."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(code)
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


def test_an_installed_package_offers_rules_by_name(isolated, capsys):
    site = isolated / "site"
    _distribution(site, "lablib", "[fedlight.algorithms]\nlab_plugged = lablib\n",
                  RULE.format(name="lab_plugged", cls="Plugged"))
    _distribution(site, "brokenlib", "[fedlight.algorithms]\nlab_broken = brokenlib\n",
                  "raise RuntimeError('the lab forgot a dependency')")
    _distribution(site, "quietlib", "[fedlight.algorithms]\nlab_silent = quietlib\n", "")  # registers nothing
    sys.path.insert(0, str(site))
    assert "lab_plugged" not in fedlight.list_algorithms() and "lablib" not in sys.modules  # nothing loaded yet

    spec = fedlight.get_algorithm("Lab_Plugged")  # an unknown name: the entry point is loaded, lazily
    assert spec.name == "lab_plugged" and spec.cls.__module__ == "lablib" and "brokenlib" not in sys.modules
    rc, err = _fit(Path("runs/p"), ["--algorithm", "lab_plugged"], capsys)
    assert rc == 0, err
    assert yaml.safe_load(Path("runs/p/config.yaml").read_text())["algorithm"]["class_path"] == "lablib.Plugged"

    with pytest.raises(ConfigError, match=r"'lab_broken' \(entry point of package brokenlib\).*the lab forgot"):
        fedlight.get_algorithm("lab_broken")
    with pytest.raises(ConfigError, match=r"'lab_silent'.*nothing registered that name.*@fedlight.register"):
        fedlight.get_algorithm("lab_silent")
    with pytest.raises(ConfigError, match="did you mean 'lab_plugged'"):
        fedlight.get_algorithm("lab_pluged")


def test_fedlight_ls_lists_installed_packages_rules(isolated, capsys):
    site = isolated / "site"
    _distribution(site, "lablib2", "[fedlight.algorithms]\nlab_listed = lablib2\n",
                  RULE.format(name="lab_listed", cls="Listed"))
    sys.path.insert(0, str(site))
    assert main(["ls", "algorithms"]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("lab_listed "))
    assert "lablib2.Listed" in row and "a lab's rule" in row


def test_a_recipe_names_a_rule_in_the_working_directory(isolated, capsys):
    (Path.cwd() / "lab_rule4.py").write_text(RULE.format(name="lab_half4", cls="Half4"))
    Path("recipe.yaml").write_text("algorithm: {class_path: lab_rule4.Half4, init_args: {knob: 0.75}}\n")
    rc = main(["fit", *TINY, "--config", "recipe.yaml", "--out_dir", "runs/r"])
    assert rc == 0, capsys.readouterr().err
    recorded = yaml.safe_load(Path("runs/r/config.yaml").read_text())["algorithm"]
    assert recorded == {"class_path": "lab_rule4.Half4", "init_args": {"knob": 0.75}}

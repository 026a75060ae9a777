"""Where recipes and table specs are found (the path as given, ./recipes/, the installed ones), what is said when one
is not, and the commands built on it: ``fit --config NAME``, ``ls recipes / tables``, ``cp``, ``--version``."""

from pathlib import Path

import pytest
import yaml

import fedlight
from fedlight.config import cli, locate
from fedlight.errors import ConfigError
from fedlight.lab.tables import spec as table_spec

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "recipes"  # a checkout: the installed recipes are the repository's (tests/test_wheel.py: a wheel's)


def test_the_bundled_recipes_are_the_repositorys_in_a_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty directory: only the installed recipes
    assert locate.bundled_dir() == BUNDLED
    assert locate.roots() == [tmp_path / "recipes", BUNDLED]
    assert [p.name for p in locate.bundled("recipe")] == sorted(p.name for p in BUNDLED.glob("*.yaml"))
    assert [p.name for p in locate.bundled("table")] == sorted(p.name for p in (BUNDLED / "tables").glob("*.yaml"))
    for ref in ("quickstart", "quickstart.yaml", "recipes/quickstart.yaml"):
        assert locate.find(ref) == BUNDLED / "quickstart.yaml", ref
    for ref in ("fednsam_table2", "fednsam_table2.yaml", "recipes/tables/fednsam_table2.yaml"):
        assert locate.find(ref, "table") == BUNDLED / "tables" / "fednsam_table2.yaml", ref
        assert table_spec.find_spec(ref) == BUNDLED / "tables" / "fednsam_table2.yaml", ref
    assert locate.find("fednsam_table2", "recipe", "table") == BUNDLED / "tables" / "fednsam_table2.yaml"
    with pytest.raises(ConfigError):
        locate.find("fednsam_table2")  # a table spec is not a recipe


def test_a_given_path_then_the_working_directorys_recipes_then_the_installed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes" / "tables").mkdir(parents=True)
    local = tmp_path / "recipes" / "quickstart.yaml"
    local.write_text("seed: 1\n")
    (tmp_path / "quickstart.yaml").write_text("seed: 2\n")
    assert locate.find("quickstart") == local  # ./recipes/ before the installed quickstart
    assert locate.find("recipes/quickstart.yaml") == Path("recipes/quickstart.yaml")  # the path as given
    assert locate.find("quickstart.yaml") == Path("quickstart.yaml")  # the path as given, before ./recipes/
    assert locate.find("fedwmsam_mlp_fmnist_dir0.1") == BUNDLED / "fedwmsam_mlp_fmnist_dir0.1.yaml"  # not local
    assert locate.find(str(BUNDLED / "quickstart.yaml")) == BUNDLED / "quickstart.yaml"
    # a table spec's `base:` follows the same order: the local recipe when there is one, else the installed one
    spec = yaml.safe_load((BUNDLED / "tables" / "fednsam_table2.yaml").read_text())
    assert table_spec.base_path(spec) == BUNDLED / "fednsam_resnet18.yaml"
    (tmp_path / "recipes" / "fednsam_resnet18.yaml").write_text("seed: 3\n")
    (tmp_path / "recipes" / "tables" / "fednsam_table2.yaml").write_text("title: mine\n")
    assert table_spec.base_path(spec) == Path("recipes/fednsam_resnet18.yaml")
    assert table_spec.find_spec("fednsam_table2") == tmp_path / "recipes" / "tables" / "fednsam_table2.yaml"


def test_a_name_not_found_says_where_it_looked_and_the_closest_bundled_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        locate.find("quickstrat")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("recipe 'quickstrat' not found (looked at quickstrat (as a path), ")
    assert f"{tmp_path / 'recipes'}/" in msg and f"{BUNDLED}/" in msg
    assert "closest bundled: quickstart;" in msg and msg.endswith("list them: fedlight ls recipes")
    with pytest.raises(ConfigError, match=r"table spec 'fednsam_tabel2' not found .*"
                                          r"closest bundled: fednsam_table2, .*fedlight ls tables$"):
        table_spec.find_spec("fednsam_tabel2")
    with pytest.raises(ConfigError) as e:
        locate.find("zzzz")
    assert "closest" not in str(e.value)
    # through the command line: one line, exit 2, before anything is built
    assert cli.main(["fit", "--config", "quickstrat", "--loop.rounds", "2"]) == 2
    assert cli.main(["reproduce", "fednsam_tabel2", "--dry-run"]) == 2


def test_fit_takes_a_bundled_name_or_a_repository_path_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    installed = str(BUNDLED / "quickstart.yaml")
    assert locate.config_args(["--config", "quickstart", "--loop.rounds", "2"]) == [
        "--config", installed, "--loop.rounds", "2"]
    assert locate.config_args(["--config=recipes/quickstart.yaml"]) == [f"--config={installed}"]
    inline = ["--config", "{loop: {rounds: 2}}"]
    assert locate.config_args(inline) == inline  # inline YAML is jsonargparse's
    kwargs, text = cli._parse("fedlight fit", ["--config", "quickstart", "--loop.rounds", "2"])
    assert kwargs["loop"].rounds == 2 and kwargs["model"].net[1].in_features == 60 and "Synthetic" in text
    _, same = cli._parse("fedlight fit", ["--config", "recipes/quickstart.yaml", "--loop.rounds", "2"])
    assert same == text


def test_ls_lists_the_bundled_recipes_and_tables_with_what_each_reproduces(capsys):
    from fedlight.config.catalog import listing

    recipes = {line.split()[0]: line for line in listing("recipes").splitlines()[1:]}
    assert set(recipes) == {p.stem for p in BUNDLED.glob("*.yaml")}
    assert all(len(line.split(None, 1)) == 2 for line in recipes.values())  # every one says what it reproduces
    assert "FedWMSAM (NeurIPS'25) Table 1 — paper: 84.64% (500 rounds)" in recipes["fedwmsam_mlp_fmnist_dir0.1"]
    assert recipes["fednsam_resnet18"].endswith("FedNSAM (MM'25) Table 2, Dir(0.6) — paper: 66.04 ± 0.11 (1000 "
                                                "rounds); 316 rounds to 55%")
    assert cli.main(["ls", "tables"]) == 0
    tables = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert set(tables) == {p.stem for p in (BUNDLED / "tables").glob("*.yaml")}
    assert tables["fedwmsam_table1"].split(None, 1)[1] == "FedWMSAM (NeurIPS'25) Table 1 — test accuracy (%) after " \
                                                          "500 rounds"


def test_cp_copies_a_recipe_or_table_out_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["cp", "quickstart"]) == 0
    assert (tmp_path / "quickstart.yaml").read_bytes() == (BUNDLED / "quickstart.yaml").read_bytes()
    assert "fedlight fit --config quickstart.yaml" in capsys.readouterr().out
    (tmp_path / "quickstart.yaml").write_text("seed: 7\n")  # the user's edit
    assert cli.main(["cp", "quickstart", "."]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "quickstart.yaml exists; not overwritten" in err
    assert (tmp_path / "quickstart.yaml").read_text() == "seed: 7\n"
    assert cli.main(["cp", "fednsam_table2", "specs/"]) == 0  # a folder (made), a table spec
    assert (tmp_path / "specs" / "fednsam_table2.yaml").read_bytes() == \
        (BUNDLED / "tables" / "fednsam_table2.yaml").read_bytes()
    assert "fedlight reproduce specs/fednsam_table2.yaml --dry-run" in capsys.readouterr().out
    assert cli.main(["cp", "recipes/fedavg_mlp_fmnist_dir0.1.yaml", "mine.yaml"]) == 0  # a file name
    assert (tmp_path / "mine.yaml").read_bytes() == (BUNDLED / "fedavg_mlp_fmnist_dir0.1.yaml").read_bytes()
    assert cli.main(["cp", "fedwmsam_tabel1"]) == 2
    assert "recipe or table spec 'fedwmsam_tabel1' not found" in capsys.readouterr().err


def test_version_is_single_sourced(capsys):
    import tomllib

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"fedlight {fedlight.__version__}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fedlight.__version__"}
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert project["project"]["license"] == "Apache-2.0"

"""The documentation site builds with warnings as errors (a broken link, reference, directive or docstring fails
here), its generated reference pages hold every command and setting, and the pictures and test references that the
pages cite exist.

The build needs the ``docs`` extra (``pip install -e ".[docs]"``; the ``dev`` extra includes it); without it that
one test is skipped, saying so. The other tests read the generators and pages directly.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SITE_PACKAGES = ("sphinx", "myst_parser", "furo")


def _missing() -> list[str]:
    return [name for name in SITE_PACKAGES if importlib.util.find_spec(name) is None]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once with warnings as errors: (output folder, warnings text)."""
    missing = _missing()
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    warnings = out / "warnings.txt"
    res = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-w", str(warnings), "-c", "docs", ".",
                          str(out / "html")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    text = warnings.read_text() if warnings.exists() else ""
    assert res.returncode == 0 and not text.strip(), f"the site has warnings (exit {res.returncode}):\n{text}\n" \
                                                      f"{res.stderr[-3000:]}"
    return out / "html"


def test_site_builds_with_warnings_as_errors(site):
    from fedlight.config.cli import COMMANDS
    from fedlight.core.loop_config import LoopConfig

    assert (site / "index.html").is_file() and (site / "docs" / "index.html").is_file()
    settings = (site / "docs" / "reference" / "settings.html").read_text()
    for f in dataclasses.fields(LoopConfig):
        assert f"loop.{f.name}" in settings, f"the settings page lacks loop.{f.name}"
    cli = (site / "docs" / "reference" / "cli.html").read_text()
    for name in COMMANDS:
        assert f"fedlight {name}" in cli, f"the command-line page lacks `fedlight {name}`"
    contract = (site / "docs" / "reference" / "api" / "contract.html").read_text()
    for name in ("LocalUpdateRule.step", "LocalUpdateRule.start", "LocalUpdateRule.finish", "ServerRule.broadcast",
                 "ServerRule.update", "LocalContext.num_steps", "Broadcast.extras", "ClientResult.delta",
                 "RoundInfo.sampled"):
        assert f'id="fedlight.core.rules.{name}"' in contract, f"the API page does not document {name}"
    assert "round.svg" in (site / "docs" / "architecture.html").read_text()
    assert list((site / "_images").glob("round*.svg")), "the round diagram was not copied into the site"
    assert (site / "docs" / "contributing" / "gpu_table.html").is_file()


# ------------------------------------------------------------------------------------------------ generated pages
def test_settings_reference_lists_every_key_with_its_kind():
    from fedlight.config import reference
    from fedlight.core.loop_config import LoopConfig
    from fedlight.privacy.settings import PrivacyConfig
    from fedlight.run.directory import EXECUTION_ONLY

    text = reference.settings_markdown()
    rows = {m[0]: m[1] for m in re.findall(r"^`([\w.]+)`[^\n]* · default `[^`]*`\n: \*([^*]+)\.\*", text, re.M)}
    for f in dataclasses.fields(LoopConfig):
        if f.name == "lr_schedule":  # a section of its own: its keys
            assert {"loop.lr_schedule.kind", "loop.lr_schedule.decay"} <= set(rows)
            continue
        assert f"loop.{f.name}" in rows, f"loop.{f.name} missing from the settings reference"
    for f in dataclasses.fields(PrivacyConfig):
        assert rows.get(f"privacy.{f.name}") == "defining", f"privacy.{f.name}"
    for key in ("seed", "model", "data", "algorithm", "loop.lr", "loop.local_steps", "precision"):
        assert rows[key] == "defining", key
    flags = [k for k in EXECUTION_ONLY if k in rows]
    assert len(flags) >= 15 and all(rows[k].startswith("execution-only") for k in flags), flags
    assert "`loop.rounds` · `int` · default `100`\n: *execution-only (defining under the cosine schedule).* " \
           "Communication rounds R." in text
    assert "`loop.sampling` · `Literal['fixed', 'poisson']` · default `fixed`\n: *defining.*" in text


def test_cli_reference_is_every_commands_help():
    from fedlight.config import reference
    from fedlight.config.cli import COMMANDS

    text = reference.cli_markdown()
    assert re.findall(r"^## `fedlight (\w+)`", text, re.M) == list(COMMANDS)
    assert "usage: fedlight fit --config RECIPE.yaml" in text and "--loop.rounds" in text
    assert reference.command_help("verify") in text


# ------------------------------------------------------------------------------------------------ pictures, pages
def _round_diagram():
    from fedtest import load_script

    return load_script(ROOT / "tools" / "round_diagram.py")


def test_the_round_diagram_names_only_calls_that_exist_and_is_the_committed_picture(tmp_path):
    diagram = _round_diagram()
    lanes = []
    for _, path in diagram.LANES:
        module, _, attr = path.rpartition(".")
        try:
            lanes.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            lanes.append(importlib.import_module(path))
    for a, b, method, text, _ in diagram.CALLS:
        if method:
            assert hasattr(lanes[b], method), f"the diagram's {text!r}: {diagram.LANES[b][1]} has no {method}"
    committed = (DOCS / "_static" / "round.svg").read_text()
    drawn = diagram.draw(tmp_path / "round.svg").read_text()
    for _, _, _, text, back in diagram.CALLS:
        for words in (text, back):
            for part in filter(None, re.split(r"\s{2,}", words)):
                escaped = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                assert escaped in drawn, part
                assert escaped in committed, f"docs/_static/round.svg lacks {part!r}: python tools/round_diagram.py"


def test_exactness_cites_tests_that_exist():
    text = (DOCS / "exactness.md").read_text()
    cited = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(cited) >= 10
    for path, name in cited:
        assert re.search(rf"^def {name}\b", (ROOT / path).read_text(), re.M), f"{path} has no {name}"
    for pattern in re.findall(r"`(tests/[\w/*]+\.py)`", text):
        assert list(ROOT.glob(pattern)), pattern


def test_getting_started_trains_the_quickstart_recipe():
    text = (DOCS / "getting_started.md").read_text()
    block = re.search(r"```yaml file=quickstart\.yaml\n(.*?)```", text, re.S).group(1)
    assert yaml.safe_load(block) == yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text()), \
        "docs/getting_started.md shows another recipe than recipes/quickstart.yaml"


def test_every_user_page_is_in_the_navigation():
    """A page of docs/ (not the folder's README, the contributor pages or the API pages, which the API index lists)
    is in exactly one section of the sidebar, docs/nav.yaml."""
    nav = yaml.safe_load((DOCS / "nav.yaml").read_text())
    listed = [page for pages in nav["sections"].values() for page in pages]
    assert len(listed) == len(set(listed)), "a page is in two sections"
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")
             if p.relative_to(DOCS).parts[0] not in ("contributing", "_ext", "_build")}
    pages -= {"README", "index"} | {p for p in pages if p.startswith("reference/api/") and p != "reference/api/index"}
    assert pages <= set(listed), f"pages missing from fedlight_nav: {sorted(pages - set(listed))}"
    assert set(listed) - pages <= set(nav.get("optional", ())), "docs/nav.yaml names a page that is not there"


def test_the_sidebar_takes_an_optional_page_once_it_exists_and_refuses_a_missing_one(tmp_path):
    from types import SimpleNamespace

    from fedtest import load_script

    ext = load_script(DOCS / "_ext" / "fedlight_site.py")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n")
    config = SimpleNamespace(root_doc="docs/index", fedlight_nav={"Tutorials": ["a", "later"]},
                             fedlight_nav_optional=("later",))
    app = SimpleNamespace(srcdir=str(tmp_path), config=config)
    assert ext.nav_markdown(app) == "\n:::{toctree}\n:hidden:\n:caption: Tutorials\n\na\n:::\n"
    (tmp_path / "docs" / "later.md").write_text("# Later\n")
    assert "\na\nlater\n:::" in ext.nav_markdown(app)
    config.fedlight_nav_optional = ()
    (tmp_path / "docs" / "later.md").unlink()
    with pytest.raises(FileNotFoundError, match="later.md"):
        ext.nav_markdown(app)


def test_a_link_to_a_repository_file_the_site_lacks_becomes_its_path_and_a_missing_one_stays_a_link():
    from types import SimpleNamespace

    from fedtest import load_script

    ext = load_script(DOCS / "_ext" / "fedlight_site.py")
    app = SimpleNamespace(srcdir=str(ROOT), env=SimpleNamespace(found_docs={"docs/design", "docs/page"}))
    text = "[the README](../README.md), [`recipes/README.md`](../recipes/README.md), [gone](gone.md), [d](design.md#x)"
    assert ext.outside_links(app, "docs/page", text) == \
        "the README (`README.md`), `recipes/README.md`, [gone](gone.md), [d](design.md#x)"

"""The README stays true: its Fabric snippet runs, its algorithm table is the registry's, its commands exist."""

import re
from pathlib import Path

import torch

from fedlight.config import catalog

README = Path(__file__).resolve().parent.parent / "README.md"


def test_fabric_snippet_runs():
    text = README.read_text()
    section = text.split("## Use a rule in your own Fabric script", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README-snippet", "exec"), scope)
    x = scope["x"]
    assert all(torch.isfinite(v).all() for v in x.values())
    assert scope["algo"].server.m is not None  # FedNSAM's server momentum moved
    assert float(sum(v.abs().sum() for v in scope["algo"].server.m.values())) > 0


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

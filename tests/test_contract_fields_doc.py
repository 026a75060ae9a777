"""docs/adding_an_algorithm.md's tables of LocalContext, Broadcast, ClientResult and RoundInfo are generated from
fedlight/core/rules.py and fedlight/core/messages.py, so they cannot drift from the dataclasses.

Regenerate: ``python tests/test_contract_fields_doc.py``."""

import dataclasses
from pathlib import Path

from fedlight.config.catalog import CONTRACT, contract_fields_markdown
from fedlight.core import rules

DOC = Path(__file__).resolve().parent.parent / "docs" / "adding_an_algorithm.md"
BEGIN = "<!-- BEGIN GENERATED: fedlight.config.catalog.contract_fields_markdown() -->"
END = "<!-- END GENERATED -->"


def render(text: str) -> str:
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{contract_fields_markdown()}{END}{tail}"


def test_the_tables_are_the_dataclasses():
    text = DOC.read_text()
    assert text == render(text), "docs/adding_an_algorithm.md is stale: python tests/test_contract_fields_doc.py"


def test_every_field_is_listed_with_a_meaning():
    table = contract_fields_markdown()
    for name in CONTRACT:
        for f in dataclasses.fields(getattr(rules, name)):
            row = next(ln for ln in table.splitlines() if ln.startswith(f"| `{f.name}` |"))
            assert len(row.rsplit("|", 2)[1].strip()) > 5, f"{name}.{f.name} has no docstring in fedlight/core/"
    for method in ("forward_backward", "grads", "apply", "loss", "set_lr", "zero_grad"):
        assert f"| `{method}(" in table


if __name__ == "__main__":
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote {DOC}")

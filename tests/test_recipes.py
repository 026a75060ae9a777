"""Every recipe and every table spec parses against ``fit``'s signature and instantiates.

Recipes (``recipes/**/*.yaml`` outside ``tables/``, found recursively): model, data module (without ``setup``, so
CIFAR-100 need not exist), algorithm and loop settings are instantiated through ``fedlight fit``'s parser. Table
specs: cells covering every row's, column's and cell's override set are instantiated the same way. To stay fast,
models are built on the ``meta`` device: every constructor runs and checks its arguments, no weights are allocated.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from fedlight.config.cli import _parse
from fedlight.core.loop_config import LoopConfig
from fedlight.core.registry import _REGISTRY, list_algorithms
from fedlight.core.rules import Algorithm
from fedlight.data import FederatedDataModule
from fedlight.lab.tables import spec as table_spec
from fedlight.lab.tables import table_report

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "tables" not in p.relative_to(ROOT).parts)
SPECS = sorted((ROOT / "recipes" / "tables").rglob("*.yaml"))
NAMED_EXCEPTIONS = {"quickstart", "fednsam_resnet18"}  # DESIGN.md: the quick start and the headline recipe


@pytest.fixture(autouse=True)
def _no_hub_download(monkeypatch):
    """Recipes with ``pretrained: true`` build their timm model without fetching weights (no network in tests)."""
    import timm

    import fedlight.models.timm as fm

    monkeypatch.setattr(fm, "hub_model", lambda name, num_classes, extra: timm.create_model(
        name, pretrained=False, num_classes=num_classes, **extra))


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def test_recipes_and_specs_are_found():
    assert len(RECIPES) >= 14 and len(SPECS) >= 16
    assert (ROOT / "recipes" / "fednsam_resnet18.yaml") in RECIPES


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_recipe_instantiates(path):
    with torch.device("meta"):  # every constructor runs and checks its arguments; no weights are allocated
        kwargs, text = _parse("fedlight fit", ["--config", str(path)])
    assert isinstance(kwargs["model"], nn.Module)
    assert isinstance(kwargs["data"], FederatedDataModule)
    assert isinstance(kwargs["algorithm"], Algorithm)
    assert isinstance(kwargs["loop"], LoopConfig)
    assert kwargs["loop"].clients_per_round <= kwargs["data"].num_clients
    assert "class_path" in text  # the resolved config that fit writes to config.yaml


@pytest.mark.parametrize("path", RECIPES, ids=rel)
def test_recipe_header_and_name(path):
    text = path.read_text()
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert text.startswith("# ") and len(header) >= 2, "a recipe starts with its header (DESIGN.md §6)"
    assert f"Run: fedlight fit --config {rel(path)}" in text
    cfg = yaml.safe_load(text)
    assert cfg.get("out_dir") in (None, f"runs/{path.stem}")
    if path.stem in NAMED_EXCEPTIONS:
        return
    assert re.search(r"Table|seed documentation", header[0] + header[1]), "the header names its source table"
    assert re.search(r"Paper|paper", "\n".join(header[:4])), "the header states the paper's number (or its absence)"
    # <algorithm>_<model>_<dataset>_<split>.yaml, algorithm = the registry name of the recipe's algorithm
    cls = cfg["algorithm"]["class_path"].rsplit(".", 1)[-1]
    name = next(n for n in list_algorithms() if _REGISTRY[n].cls.__name__ == cls)
    assert path.stem.startswith(name + "_"), f"{path.name} should start with {name}_"
    assert len(path.stem[len(name) + 1:].split("_")) == 3, f"{path.name}: <algorithm>_<model>_<dataset>_<split>"


def cover(spec: dict, cells: list[table_spec.Cell]) -> list[table_spec.Cell]:
    """Cells that together use every row's, column's and cell's override set (first column × rows, first row ×
    columns, and the cells with their own overrides)."""
    rows, cols, own = list(spec["rows"]), list(spec["columns"]), set(spec.get("cell_overrides") or {})
    chosen = [c for c in cells if c.col == cols[0] or c.row == rows[0] or c.name in own]
    return list({c.run_key: c for c in chosen}.values())  # columns that differ only in metric share their runs


@pytest.mark.parametrize("path", SPECS, ids=rel)
def test_table_spec_cells_instantiate(path):
    spec = table_spec.load_spec(path)
    assert table_spec.base_path(spec).is_file()
    text = path.read_text()
    assert f"fedlight reproduce {rel(path)}" in text, "the header gives the run command"
    assert str(spec.get("notes", "")).strip(), "the spec says how its setup differs from the paper"
    cells = table_spec.cells(spec)
    assert len({c.name for c in cells}) == len(cells)
    for c in cover(spec, cells):
        with torch.device("meta"):
            kwargs, _ = _parse("fedlight fit", ["--config", str(path.parent.parent.parent / spec["base"]),
                                                *table_spec.flags(c.overrides)])
        assert isinstance(kwargs["algorithm"], Algorithm), c.name
    # every paper value is a number, or text that starts with one, or "not reached"
    for row in (spec.get("paper") or {}).values():
        for v in row.values():
            assert table_report.number(v) is not None or v == "not reached", v


def resolved(spec_name: str, cell: str) -> dict:
    spec = table_spec.load_spec(table_spec.find_spec(spec_name))
    c = next(c for c in table_spec.cells(spec) if c.name == cell)
    with torch.device("meta"):
        _, text = _parse("fedlight fit", ["--config", str(ROOT / spec["base"]), *table_spec.flags(c.overrides)])
    return yaml.safe_load(text)


def test_fedwmsam_table1_fashion_mnist_column_is_the_papers_setting():
    spec = table_spec.load_spec(table_spec.find_spec("fedwmsam_table1"))
    rows = set(spec["rows"])
    assert {"fedavg", "fedcm", "scaffold", "fedsam", "mofedsam", "fedgamma", "fedsmoo", "fedlesam", "fedlesam_s",
            "fedlesam_d", "fedwmsam"} <= rows
    rho = {"fedsam": 0.01, "fedgamma": 0.01, "fedlesam": 0.01, "fedlesam_s": 0.01, "fedlesam_d": 0.01,
           "fedwmsam": 0.01, "fedsmoo": 0.1, "mofedsam": 0.1}
    for row in sorted(rows - {"fedwmsam_released"}):
        cfg = resolved("fedwmsam_table1", f"{row}/fmnist_dir0.1")
        assert cfg["algorithm"]["class_path"].rsplit(".", 1)[-1] == _REGISTRY[row].cls.__name__
        assert cfg["algorithm"].get("init_args", {}).get("rho") == rho.get(row), row
        data, loop = cfg["data"]["init_args"], cfg["loop"]
        assert cfg["data"]["class_path"] == "fedlight.data.FashionMNIST"
        assert (data["num_clients"], data["batch_size"], data["partition"]["init_args"]["alpha"]) == (100, 50, 0.1)
        assert (loop["clients_per_round"], loop["local_epochs"], loop["rounds"]) == (10, 5, 500)
        assert (loop["lr"], loop["lr_schedule"], loop["weight_decay"]) == (0.1, {"kind": "exponential",
                                                                                "decay": 0.998}, 1e-3)
        assert table_report.number(spec["paper"][row]["fmnist_dir0.1"]) is not None
    assert spec["paper"]["fedwmsam"]["fmnist_dir0.1"] == 84.64 and spec["paper"]["fedavg"]["fmnist_dir0.1"] == 82.26


def test_table_cell_overrides_reach_the_config():
    cfg = resolved("fedadamw_table1", "fedadamw/vittiny")
    assert cfg["model"]["class_path"] == "fedlight.models.ViTTiny"
    assert cfg["algorithm"]["init_args"]["blocks"] == "hessian"
    assert resolved("fedadamw_table1", "fedadamw/resnet18")["algorithm"]["init_args"]["blocks"] == "tensor"
    cfg = resolved("fedwmsam_table1", "fedsmoo/cifar100_path10")
    assert cfg["model"]["class_path"] == "fedlight.models.ResNet34"
    assert cfg["data"]["init_args"]["partition"] == {"class_path": "fedlight.data.Pathological",
                                                     "init_args": {"classes_per_client": 10}}
    assert cfg["algorithm"]["init_args"] == {"rho": 0.1, "lam": 0.1}
    assert resolved("fedwmsam_table4", "fedavg/e20")["loop"]["local_epochs"] == 20

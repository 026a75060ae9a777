"""FedNSAM Table 2's spec against the paper (FedNSAM, MM'25; the text in ``shared/papers/003_*.txt``), cell by cell:
every column's accuracy after 1000 rounds and rounds to its target as Table 2 prints them, and every run of the grid
resolved as ``fedlight reproduce`` runs it (base recipe + the cell's overrides, through the ``fit`` parser) with the
set-up of §6.1: 100 clients, 10 % per round, E = 5 (K = 50), batch 50, lr 0.1 decayed 0.998 per round, 1000 rounds,
Dir(0.6), FedNSAM ρ = 0.1 and λ = 0.85, and the column's model and data set."""

import re
from pathlib import Path

import pytest
import yaml

from fedlight.lab.tables import spec as table_spec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "recipes" / "tables" / "fednsam_table2.yaml"
ROWS = ("fedavg", "fedavgm", "scaffold", "fedacg", "fedsam", "mofedsam", "fedgamma", "fedlesam", "fednsam")
# Table 2's columns: (spec column, its rounds column, target, model, data set, classes). The CIFAR-100 ResNet-18
# column is the spec's `dir0.6` (the base recipe).
COLUMNS = (("lenet5_cifar10", "lenet5_cifar10_to78", 0.78, "LeNet5", "CIFAR10", 10),
           ("vgg11_cifar10", "vgg11_cifar10_to80", 0.80, "VGG11", "CIFAR10", 10),
           ("resnet18_cifar10", "resnet18_cifar10_to85", 0.85, "ResNet18", "CIFAR10", 10),
           ("lenet5_cifar100", "lenet5_cifar100_to52", 0.52, "LeNet5", "CIFAR100", 100),
           ("vgg11_cifar100", "vgg11_cifar100_to53", 0.53, "VGG11", "CIFAR100", 100),
           ("dir0.6", "dir0.6_to55", 0.55, "ResNet18", "CIFAR100", 100))
# Table 2 as printed, one line per row in the order of COLUMNS: accuracy (mean ± std; "—" where the paper prints
# no number) and rounds to the column's target ("1000+": not reached in 1000 rounds).
TABLE2 = """
fedavg   79.63±0.27 574 84.14±0.32 313 88.92±0.24 542 41.15±0.18 1000+ 48.94±0.39 1000+ 54.25±0.39 1000+
fedavgm  81.15±0.23 659 83.74±0.11 794 89.05±0.36 656 48.35±0.29 1000+ 51.94±0.17 1000+ 60.91±0.37 516
scaffold 79.43±0.33 799 86.94±0.09 272 88.56±0.21 543 50.21±0.35 1000+ 50.81±0.28 1000+ 54.12±0.15 1000+
fedacg   82.84±0.28 301 84.86±0.14 249 90.62±0.31 222 53.04±0.19 729 51.55±0.34 1000+ 61.92±0.31 521
fedsam   81.21±0.16 361 85.26±0.27 227 86.78±0.13 313 48.12±0.22 1000+ 47.71±0.09 1000+ 47.83±0.25 628
mofedsam 83.42±0.20 255 — 1000+ 86.66±0.37 530 50.11±0.10 1000+ — 1000+ 60.15±0.24 1000+
fedgamma 81.02±0.24 371 86.33±0.25 169 88.35±0.29 542 41.33±0.23 1000+ 53.42±0.32 908 49.83±0.35 1000+
fedlesam 79.75±0.30 496 83.54±0.18 169 89.01±0.35 480 41.33±0.24 1000+ 49.26±0.21 1000+ 52.11±0.21 1000+
fednsam  83.82±0.15 181 87.86±0.29 137 91.35±0.33 272 53.61±0.20 633 56.33±0.31 334 66.04±0.11 316
"""


def table2() -> dict[tuple[str, str], object]:
    """``(row, spec column) -> value`` as the spec writes it: "79.63 ± 0.27", 574, "not reached", or "absent" (the
    paper prints no number)."""
    out = {}
    for line in TABLE2.strip().splitlines():
        row, *cells = line.split()
        assert len(cells) == 2 * len(COLUMNS), row
        for (acc_col, to_col, *_), acc, rounds in zip(COLUMNS, cells[::2], cells[1::2]):
            out[row, acc_col] = "absent" if acc == "—" else acc.replace("±", " ± ")
            out[row, to_col] = "not reached" if rounds == "1000+" else int(rounds)
    return out


def paper_text() -> str | None:
    for shared in (ROOT.parent / "shared", ROOT.parent.parent / "shared"):
        found = sorted((shared / "papers").glob("003_*.txt")) if (shared / "papers").is_dir() else []
        if found:
            return found[0].read_text()
    return None


def test_transcription_matches_the_paper_text():
    """TABLE2 above is Table 2 of the paper text, where the text is on this machine."""
    text = paper_text()
    if text is None:
        pytest.skip("the paper text (../shared/papers/003_*.txt) is not on this machine")
    start = text.index("Table 2: Comparison of testing accuracy")
    names = {"FedAvg": "fedavg", "FedAvgM": "fedavgm", "SCAFFOLD": "scaffold", "FedACG": "fedacg", "FedSAM": "fedsam",
             "MoFedSAM": "mofedsam", "FedGAMMA": "fedgamma", "FedLESAM": "fedlesam", "FedNSAM": "fednsam"}
    printed = {}
    for line in text[start:start + 4000].splitlines():
        cells = re.sub(r"</?b>", "", line).split("\t")
        if cells[0] in names:
            printed[names[cells[0]]] = " ".join(c.replace(" ", "") for c in cells[1:])
    ours = {line.split()[0]: " ".join(line.split()[1:]) for line in TABLE2.strip().splitlines()}
    assert printed == ours


def test_every_table2_cell_of_the_spec_is_the_papers():
    spec = yaml.safe_load(SPEC.read_text())
    paper = spec["paper"]
    want = table2()
    wrong = [f"{r}/{c}: spec {paper.get(r, {}).get(c, 'absent')!r}, paper {v!r}" for (r, c), v in want.items()
             if paper.get(r, {}).get(c, "absent") != v]
    assert not wrong, "\n".join(wrong)
    assert set(paper) == set(ROWS)  # fedcm and fedsmoo are fedlight's extra rows: no paper values
    for acc_col, to_col, target, *_ in COLUMNS:
        assert spec["columns"][to_col]["metric"] == f"rounds_to_target:{target:.2f}"
        assert {k: v for k, v in spec["columns"][to_col].items() if k != "metric"} == (spec["columns"][acc_col] or {})


def test_each_rounds_column_reads_the_runs_of_its_accuracy_column():
    spec = table_spec.load_spec(SPEC)
    keys = {c.name: c.run_key for c in table_spec.cells(spec)}
    for acc_col, to_col, *_ in COLUMNS:
        for row in spec["rows"]:
            assert keys[f"{row}/{to_col}"] == keys[f"{row}/{acc_col}"] == f"{row}/{acc_col}"
    assert len(set(keys.values())) == len(spec["rows"]) * 7  # 6 Table 2 columns + Table 4's Dir(0.1)


def resolved(spec: dict, cell, parser):
    from fedlight.config import flags

    argv = flags.resolve_names(["--config", str(table_spec.base_path(spec)), *table_spec.flags(cell.overrides)])
    return parser.parse_args(argv)


def test_every_run_carries_the_set_up_of_section_6_1():
    from fedlight.config.cli import _parser

    parser = _parser("fedlight fit", docs=False)
    spec = table_spec.load_spec(SPEC)
    column = {c[0]: c for c in COLUMNS}
    wrong = []
    # The set-up does not depend on the row (its algorithm): FedAvg and FedNSAM on every column, every row on the
    # LeNet-5 CIFAR-10 column (tools/gpu_table.sh's).
    runs = {c.run_key: c for c in table_spec.cells(spec) if c.row in ("fedavg", "fednsam") or c.col == "lenet5_cifar10"}
    for cell in runs.values():
        cfg = resolved(spec, cell, parser)
        loop, data = cfg.loop, cfg.data.init_args
        part = data.partition.init_args
        model, dataset, classes = column.get(cell.run_key.split("/")[1], column["dir0.6"])[3:]
        k = loop.local_steps or 5 * 500 // data.batch_size  # E = 5 over 500 samples per client
        got = {"clients": data.num_clients, "per_round": loop.clients_per_round, "rounds": loop.rounds, "K": k,
               "E": loop.local_epochs, "batch": data.batch_size, "lr": loop.lr, "decay": loop.lr_schedule.decay,
               "schedule": loop.lr_schedule.kind, "alpha": part.alpha, "replacement": part.with_replacement,
               "model": cfg.model.class_path.rsplit(".", 1)[1], "num_classes": cfg.model.init_args.num_classes,
               "data": cfg.data.class_path.rsplit(".", 1)[1], "eval_every": loop.eval_every}
        want = {"clients": 100, "per_round": 10, "rounds": 1000, "K": 50, "E": 5, "batch": 50, "lr": 0.1,
                "decay": 0.998, "schedule": "exponential", "alpha": 0.1 if cell.col == "dir0.1" else 0.6,
                "replacement": True, "model": model, "num_classes": classes, "data": dataset,
                "eval_every": 10 if model == "LeNet5" else 1}
        if cfg.algorithm.class_path.endswith(".FedNSAM"):
            got["rho_lam"] = (cfg.algorithm.init_args["rho"], cfg.algorithm.init_args["lam"])
            want["rho_lam"] = (0.1, 0.85)
        wrong += [f"{cell.run_key}: {k} {got[k]!r}, paper {v!r}" for k, v in want.items() if got[k] != v]
    assert not wrong, "\n".join(wrong)

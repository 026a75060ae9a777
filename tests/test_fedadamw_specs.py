"""Every FedAdamW table spec carries the set-up the paper states (FedAdamW, AAAI'26, arXiv:2510.27486; the text in
``shared/papers/001_*.txt``): each cell of each spec is resolved as ``fedlight reproduce`` would run it (base recipe
+ the cell's overrides, through the ``fit`` parser) and its lr, weight decay, betas, global lr, clients, rounds,
local steps, batch, in-round schedule and seeds are compared with the paper's values below."""

import re
from pathlib import Path

import pytest
import yaml

from fedlight.lab.tables import spec as table_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = sorted((ROOT / "recipes" / "tables").glob("fedadamw_*.yaml"))

SGD_TYPE = {"FedAvg", "SCAFFOLD", "FedCM", "FedAdam"}
ADAM_TYPE = {"LocalAdam", "LocalAdamW", "FedLADA", "FedAdamW"}

# The paper's stated set-ups. "Experiments / Hyperparameter Settings" (p. 6): SGD-type methods weight decay 0.001;
# Adam-type β1 = 0.9, β2 = 0.999; FedAdamW α = 0.5, λ = 0.01; "All results are averaged over 5 runs".
SCRATCH = {  # Appendix C, "Setting for ResNet-18" and "Setting for ViT-Tiny" (and Table 1's caption): 100 clients,
    # 10 % per round, 300 rounds, K = 50, batch 50; local lr 0.1 (SGD-type) / 3e-4 (Adam-type); FedAdam global lr
    # 0.01, FedAdamW 1.0; weight decay 0.001 (SGD-type) / 0.01 (Local Adam, FedLADA, Local AdamW, FedAdamW; ViT-Tiny
    # "Weight Decay" list). No in-round schedule is stated for these set-ups.
    "clients": 100, "per_round": 10, "rounds": 300, "K": 50, "batch": 50, "lr": {"sgd": 0.1, "adam": 3e-4},
    "wd": {"sgd": 0.001, "adam": 0.01}, "local_lr_schedule": None}
SWIN = {  # Appendix C, "Swin Transformer Fine-tuning Settings" (and Table 2's caption): 100 clients, 5 %, 100 rounds,
    # K = 50, batch 16; local lr 0.01 / 1e-4; weight decay 0.001 / 0.01; "Cosine decay is applied to local learning
    # rates over the 50 local steps per round".
    "clients": 100, "per_round": 5, "rounds": 100, "K": 50, "batch": 16, "lr": {"sgd": 0.01, "adam": 1e-4},
    "wd": {"sgd": 0.001, "adam": 0.01}, "local_lr_schedule": "cosine"}
ROBERTA = {  # Appendix C, "RoBERTa-Base Fine-Tuning Settings" / Table 9 (and Table 3's text): 20 clients, 20 % (4
    # per round), 100 rounds, K = 50, batch 32; local lr 0.1 / 1e-4; weight decay 0.001 / 0.01; "cosine learning
    # rate decay across local updates".
    "clients": 20, "per_round": 4, "rounds": 100, "K": 50, "batch": 32, "lr": {"sgd": 0.1, "adam": 1e-4},
    "wd": {"sgd": 0.001, "adam": 0.01}, "local_lr_schedule": "cosine"}
SETUP = {"fedadamw_table1.yaml": SCRATCH, "fedadamw_table4.yaml": SCRATCH, "fedadamw_table5.yaml": SCRATCH,
         "fedadamw_table6.yaml": SCRATCH, "fedadamw_table7.yaml": SCRATCH, "fedadamw_table11.yaml": SCRATCH,
         "fedadamw_table2.yaml": SWIN, "fedadamw_table3.yaml": ROBERTA,
         "fedadamw_figure1_shakespeare.yaml": None}  # Figure 1(b): "tuned learning rates", no set-up stated
SERVER_LR = {"FedAdam": 0.01, "FedAdamW": 1.0}  # Appendix C, every set-up: "FedAdam: global LR = 0.01; FedAdamW 1.0"


def resolved(spec_path: Path, cell) -> object:
    """The cell's configuration as ``fedlight reproduce`` runs it (the ``fit`` parser, no instantiation)."""
    from fedlight.config import flags
    from fedlight.config.cli import _parser

    spec = yaml.safe_load(spec_path.read_text())
    argv = flags.resolve_names(["--config", str(table_spec.base_path(spec)), *table_spec.flags(cell.overrides)])
    return _parser("fedlight fit", docs=False).parse_args(argv)


def stated(setup: dict, cfg, row: str) -> dict:
    """What the paper states for this cell, and what the cell runs: ``{name: (paper, fedlight)}``."""
    algo = cfg.algorithm.class_path.rsplit(".", 1)[-1]
    init = cfg.algorithm.init_args or {}
    kind = "sgd" if algo in SGD_TYPE else "adam"
    assert algo in SGD_TYPE | ADAM_TYPE, algo
    out = {"clients": (setup["clients"], cfg.data.init_args.num_clients),
           "per_round": (setup["per_round"], cfg.loop.clients_per_round), "rounds": (setup["rounds"], cfg.loop.rounds),
           "K": (setup["K"], cfg.loop.local_steps), "batch": (setup["batch"], cfg.data.init_args.batch_size),
           "lr": (setup["lr"][kind], cfg.loop.lr)}
    if setup["local_lr_schedule"]:
        out["local_lr_schedule"] = (setup["local_lr_schedule"], cfg.loop.local_lr_schedule)
    wd = {"LocalAdam": "weight_decay", "LocalAdamW": "weight_decay", "FedAdamW": "lam"}.get(algo)
    got_wd = init[wd] if wd else cfg.loop.weight_decay
    want_wd = setup["wd"][kind]
    if m := re.search(r"_lam([0-9.]+)$", row):  # Table 6: the row's own λ
        want_wd = float(m.group(1))
    if algo == "FedAdamW" and init.get("variant") == 3:  # Algorithm 3 (Table 11): β1 = 0, λ = 0 (Appendix A)
        out["lam"], out["beta1"] = (0.0, init.get("lam") or 0.0), (0.0, init.get("beta1") or 0.0)
    else:
        out["weight_decay"] = (want_wd, got_wd)
        if kind == "adam":
            out["beta1"] = (0.9, 0.9 if init.get("beta1") is None else init["beta1"])
            out["beta2"] = (0.999, init["beta2"])
    if algo in SERVER_LR:
        out["server_lr"] = (SERVER_LR[algo], init["server_lr"])
    return out


@pytest.mark.parametrize("spec_path", SPECS, ids=lambda p: p.stem)
def test_spec_rows_carry_the_papers_stated_hyperparameters(spec_path):
    assert spec_path.name in SETUP, f"{spec_path.name}: add its paper set-up to SETUP"
    spec = yaml.safe_load(spec_path.read_text())
    assert spec.get("seeds") == 5  # "All results are averaged over 5 runs" (Experiments, p. 6)
    setup = SETUP[spec_path.name]
    if setup is None:
        return
    wrong = []
    for cell in table_spec.cells(spec):
        for name, (paper, ours) in stated(setup, resolved(spec_path, cell), cell.row).items():
            if paper != pytest.approx(ours, rel=1e-12) if isinstance(paper, float) else paper != ours:
                wrong.append(f"{cell.row}/{cell.col}: {name} {ours!r}, paper {paper!r}")
    assert not wrong, "\n".join(wrong)

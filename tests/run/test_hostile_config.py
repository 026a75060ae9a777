"""Hostile configs: each malformed config or CLI invocation exits 2 with one readable message naming the
setting, no traceback, and writes nothing into an existing run directory."""

import hashlib
from pathlib import Path

import pytest

from fedlight.config import cli

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"

# (extra CLI args, substring the message must contain)
CLI_CASES = [
    (["--loop.rounds", "abc"], "loop.rounds"), (["--loop.rounds", "-1"], "loop.rounds"),
    (["--loop.rounds", "0"], "loop.rounds"), (["--loop.rounds", "1.5"], "loop.rounds"),
    (["--loop.clients_per_round", "0"], "loop.clients_per_round"),
    (["--loop.clients_per_round", "-3"], "loop.clients_per_round"),
    (["--loop.clients_per_round", "100"], "loop.clients_per_round"),
    (["--loop.local_steps", "0"], "loop.local_steps"), (["--loop.local_epochs", "0"], "loop.local_epochs"),
    (["--loop.local_epochs", "2"], "local_epochs"),  # both set (the config sets local_steps)
    (["--loop.lr", "0"], "loop.lr"), (["--loop.lr", "-1"], "loop.lr"), (["--loop.lr", "nan"], "loop.lr"),
    (["--loop.lr", "inf"], "loop.lr"), (["--loop.lr", "abc"], "loop.lr"),
    (["--loop.momentum", "1.0"], "loop.momentum"), (["--loop.momentum", "-0.1"], "loop.momentum"),
    (["--loop.weight_decay", "-1"], "loop.weight_decay"), (["--loop.max_grad_norm", "0"], "loop.max_grad_norm"),
    (["--loop.max_grad_norm", "-1"], "loop.max_grad_norm"), (["--loop.weighting", "foo"], "loop.weighting"),
    (["--loop.eval_every", "0"], "loop.eval_every"), (["--loop.save_every", "0"], "loop.save_every"),
    (["--loop.targets", "[1.5]"], "loop.targets"), (["--loop.targets", "[0]"], "loop.targets"),
    (["--loop.client_dropout", "1.0"], "loop.client_dropout"),
    (["--loop.client_dropout", "-0.1"], "loop.client_dropout"),
    (["--loop.on_nonfinite", "ignore"], "loop.on_nonfinite"),
    (["--loop.lr_schedule.kind", "step"], "loop.lr_schedule.kind"),
    (["--loop.lr_schedule.decay", "0"], "loop.lr_schedule.decay"),
    (["--loop.lr_schedule.decay", "1.5"], "loop.lr_schedule.decay"),
    (["--loop.optimizer", "torch.optim.Nope"], "loop.optimizer"),
    (["--seed", "abc"], "seed"), (["--devices", "0"], "devices"), (["--devices", "-1"], "devices"),
    (["--num_nodes", "0"], "num_nodes"), (["--precision", "8-bit"], "precision"),
    (["--accelerator", "tpu9"], "accelerator"),
    (["--data.batch_size", "0"], "batch_size"), (["--data.batch_size", "-5"], "batch_size"),
    (["--data.num_clients", "0"], "num_clients"), (["--data.alpha", "-1"], "data.alpha"),
    (["--model.hidden", "abc"], "model"), (["--model.num_classes", "0"], "num_classes"),
    (["--algorithm", "fedprox", "--algorithm.mu", "-1"], "algorithm.mu"),
    (["--algorithm", "fedsam", "--algorithm.rho", "-1"], "algorithm.rho"),
    (["--algorithm", "fedavgm", "--algorithm.beta", "1"], "algorithm.beta"),
    (["--algorithm", "fedcm", "--algorithm.alpha", "2"], "algorithm.alpha"),
    (["--algorithm", "fednsam", "--algorithm.lam", "1.5"], "algorithm.lam"),
    (["--algorithm", "fedswa", "--algorithm.rho", "2"], "algorithm.rho"),
    (["--algorithm", "fedwmsam", "--algorithm.gamma", "2"], "algorithm.gamma"),
    (["--algorithm", "fedcm_client", "--algorithm.beta", "1"], "algorithm.beta"),
    (["--algorithm", "scaffold", "--algorithm.server_lr", "0"], "algorithm.server_lr"),
    (["--algorithm", "feddyn", "--algorithm.alpha", "0"], "algorithm.alpha"),
    (["--algorithm", "fedadam", "--algorithm.tau", "-1"], "algorithm.tau"),
    (["--algorithm", "fedadamw", "--algorithm.blocks", "rows"], "algorithm.blocks"),
    (["--algorithm", "nosuch"], "algorithm"), (["--model", "fedlight.models.Nope"], "model"),
    (["--data", "fedlight.data.Nope"], "data"), (["--foo", "1"], "--foo"),
    (["--resume", "/nonexistent/last.ckpt"], "resume"),
]

YAML_CASES = {
    "empty file": ("", "model"),
    "yaml syntax error": ("model: [unclosed\n", "config"),
    "top-level list": ("- 1\n- 2\n", "config"),
    "unknown top-level key": ("{extra_key: 1}", "extra_key"),
    "missing model": ("data: {class_path: fedlight.data.Synthetic}\n", "model"),
    "model without class": ("model: 3\ndata: {class_path: fedlight.data.Synthetic}\n", "model"),
}


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("existing") / "run"
    assert cli.main(["fit", "--config", str(TINY), "--out_dir", str(out), "--loop.rounds", "1"]) == 0
    return out


def _digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.rglob("*"))
            if p.is_file()}


def _check(argv, needle, existing_run, capsys):
    before = _digest(existing_run)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("fedlight fit: error:") and err.count("error:") == 1, err
    assert needle in err, err
    assert _digest(existing_run) == before


@pytest.mark.parametrize("args,needle", CLI_CASES, ids=[" ".join(a) for a, _ in CLI_CASES])
def test_hostile_cli(args, needle, existing_run, capsys):
    _check(["fit", "--config", str(TINY), "--out_dir", str(existing_run), "--resume", "auto", *args], needle,
           existing_run, capsys)


@pytest.mark.parametrize("case", YAML_CASES)
def test_hostile_yaml(case, existing_run, capsys, tmp_path):
    text, needle = YAML_CASES[case]
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    _check(["fit", "--config", str(cfg), "--out_dir", str(existing_run), "--resume", "auto"], needle, existing_run,
           capsys)


def test_missing_config_file(existing_run, capsys):
    _check(["fit", "--config", "/nonexistent/recipe.yaml", "--out_dir", str(existing_run)], "recipe.yaml",
           existing_run, capsys)


def test_count():
    assert len(CLI_CASES) + len(YAML_CASES) + 1 >= 50

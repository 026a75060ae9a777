"""CLI: help text comes from field docstrings; bad input exits 2 with one readable message, before training."""

from pathlib import Path

import pytest

from fedlight import cli

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")


def test_help_lists_commands(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for cmd in ("fit", "ls", "partition"):
        assert cmd in out


def test_fit_help_shows_field_docstrings(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Clients sampled each round (S), without replacement" in out
    assert "Joint L2 clip of the local step direction" in out


def test_ls_lists_every_algorithm(capsys):
    import fedlight

    assert cli.main(["ls", "algorithms"]) == 0
    out = capsys.readouterr().out
    for name in fedlight.list_algorithms():
        assert f"\n{name} " in "\n" + out
    assert cli.main(["ls"]) == 0
    out = capsys.readouterr().out
    assert "fedlight.models.ResNet18" in out and "fedlight.data.Dirichlet" in out and "recipes/quickstart.yaml" in out


def test_partition_report(capsys):
    assert cli.main(["partition", "--config", TINY]) == 0
    assert "client" in capsys.readouterr().out.lower()


BAD = {
    "unknown algorithm": (["--algorithm", "fedlight.algorithms.NoSuchAlgo"], "NoSuchAlgo"),
    "clients_per_round > num_clients": (["--loop.clients_per_round", "20"], "exceeds `data.num_clients` (6)"),
    "alpha <= 0": (["--data", "fedlight.data.FashionMNIST", "--data.partition", "fedlight.data.Dirichlet",
                    "--data.partition.alpha", "0"], "alpha"),
    "batch size 0": (["--data.batch_size", "0"], "batch_size"),
    "rounds 0": (["--loop.rounds", "0"], "loop.rounds"),
    "negative lr": (["--loop.lr", "-0.1"], "loop.lr"),
    "fewer samples than clients": (["--data", "fedlight.data.FashionMNIST", "--data.num_clients", "50",
                                    "--data.subset", "20", "--loop.clients_per_round", "10"], "clients"),
    "missing data files": (["--data", "fedlight.data.CIFAR100", "--data.root", "/nonexistent",
                            "--loop.clients_per_round", "4"], "FEDLIGHT_DATA"),
    "16-mixed with SAM": (["--algorithm", "fedlight.algorithms.FedSAM", "--precision", "16-mixed"], "16-mixed"),
    "unknown precision": (["--precision", "8-bit"], "precision"),
    "resume missing": (["--resume", "/nonexistent/last.ckpt"], "not found"),
    "out-of-range hyperparameter": (["--algorithm", "fedlight.algorithms.FedAvgM", "--algorithm.beta", "1.5"],
                                    "beta"),
    "unknown key": (["--loop.roundz", "3"], "roundz"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_exits_2_with_one_message(case, capsys, tmp_path):
    args, needle = BAD[case]
    out_dir = tmp_path / "run"
    code = cli.main(["fit", "--config", TINY, "--out_dir", str(out_dir), *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("fedlight fit: error:") and err.count("error:") == 1, err
    assert needle in err, err
    assert not (out_dir / "metrics.jsonl").exists()


def test_corrupt_checkpoint_is_refused(capsys, tmp_path):
    bad = tmp_path / "last.ckpt"
    bad.write_bytes(b"not a checkpoint")
    assert cli.main(["fit", "--config", TINY, "--out_dir", str(tmp_path / "r"), "--resume", str(bad)]) == 2
    assert "corrupt" in capsys.readouterr().err

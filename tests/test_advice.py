"""An adaptive rule comes with its paper's learning rate unless the user chose one; a chosen value outside the range
in which the rule trains warns before round 1 (fedlight.config.advice)."""

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import fedlight
from fedlight.config import cli
from fedlight.config.advice import check_scales
from fedlight.core.loop_config import LoopConfig
from fedlight.core.scale import ScaleWarning, scales_of

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")  # SCAFFOLD at loop.lr 0.05
ADAPTIVE = ("fedadamw", "local_adam", "local_adamw", "fedlada", "fedadam")


def _parse(*args):
    kwargs, text = cli._parse("fedlight fit", ["--config", TINY, *args])
    return kwargs, text


@pytest.mark.parametrize("name", ADAPTIVE)
def test_adaptive_rules_declare_their_scale(name):
    cls = fedlight.get_algorithm(name).cls
    assert scales_of(cls), f"{name} divides by √v: declare `scales` (fedlight.config.advice.Scale)"
    for s in scales_of(cls):
        assert s.low <= s.paper <= s.high
        group, _, key = s.key.partition(".")
        assert key in ({f.name for f in fields(LoopConfig)} if group == "loop" else inspect.signature(cls).parameters)


def test_switching_to_an_adaptive_rule_takes_its_paper_lr(capsys):
    kwargs, text = _parse("--algorithm", "fedadamw")
    assert kwargs["loop"].lr == pytest.approx(3e-4)
    assert "lr: 0.0003" in text  # config.yaml records what trains
    err = capsys.readouterr().err
    assert "`loop.lr` set to 0.0003" in err and "0.05" in err


def test_a_carried_over_server_lr_takes_fedadams_paper_value(tmp_path, capsys):
    recipe = tmp_path / "sam.yaml"
    sam = "class_path: fedlight.algorithms.FedSAM\n  init_args: {server_lr: 1.0}"
    recipe.write_text(Path(TINY).read_text().replace("class_path: fedlight.algorithms.SCAFFOLD", sam))
    kwargs, _ = cli._parse("fedlight fit", ["--config", str(recipe), "--algorithm", "fedadam"])
    assert kwargs["algorithm"].server.lr == pytest.approx(0.01)
    assert "`algorithm.server_lr` set to 0.01" in capsys.readouterr().err


@pytest.mark.parametrize("args", [("--algorithm", "fedadamw", "--loop.lr", "0.1"),
                                  ("--algorithm", "local_adam", "--loop.lr=0.002")])
def test_a_chosen_lr_is_kept(args, capsys):
    kwargs, _ = _parse(*args)
    assert kwargs["loop"].lr == pytest.approx(float(args[-1].split("=")[-1]))
    assert "note" not in capsys.readouterr().err


def test_the_rules_own_recipe_keeps_its_lr():
    kwargs, _ = cli._parse("fedlight fit", ["--config", "recipes/fedadamw_resnet18_cifar100_dir0.1.yaml",
                                           "--data.init_args.root", "/nonexistent"])
    assert kwargs["loop"].lr == pytest.approx(3e-4)


def test_sgd_rules_are_untouched():
    kwargs, _ = _parse("--algorithm", "fedsam")
    assert kwargs["loop"].lr == pytest.approx(0.05) and not scales_of(kwargs["algorithm"])


def test_out_of_range_warns_before_training():
    algo = fedlight.create("fedadamw")
    with pytest.warns(ScaleWarning, match=r"`loop.lr` 0.1 is outside .* FedAdamW .* paper uses 0.0003"):
        check_scales(algo, LoopConfig(lr=0.1))
    with pytest.warns(ScaleWarning, match="algorithm.server_lr"):
        check_scales(fedlight.create("fedadam", server_lr=1.0), LoopConfig())


def test_fit_warns_and_the_cli_prints_one_line(tmp_path, capsys):
    code = cli.main(["fit", "--config", TINY, "--algorithm", "local_adamw", "--loop.lr", "0.5", "--loop.rounds", "1",
                     "--out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code in (0, 1), err
    assert "fedlight: warning: `loop.lr` 0.5 is outside the range in which LocalAdamW trains" in err
    assert "Warning:" not in err and "Traceback" not in err


def test_print_config_shows_the_paper_lr(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", TINY, "--algorithm", "fedadamw", "--print_config"])
    assert "lr: 0.0003" in capsys.readouterr().out


def test_an_explicit_lr_from_python_is_used_even_at_sgds_value(capsys):
    """Issue 50: LoopConfig(lr=0.1) passed to fedlight.fit with FedAdamW trained at 3e-4 (0.1 was the default and
    could not be told from it). The default is now unset (None): the rule's own."""
    from fedlight.config.advice import python_defaults

    adamw, fedavg = fedlight.create("fedadamw"), fedlight.create("fedavg")
    assert python_defaults(adamw, LoopConfig(lr=0.1)).lr == 0.1 and "note" not in capsys.readouterr().err
    assert python_defaults(adamw, LoopConfig()).lr == pytest.approx(3e-4)
    assert "`loop.lr` set to 0.0003, FedAdamW's paper value (unset" in capsys.readouterr().err
    assert python_defaults(fedavg, LoopConfig()).lr == 0.1 and LoopConfig().lr is None
    assert LoopConfig().for_rule(adamw).lr == pytest.approx(3e-4) and LoopConfig(lr=0.2).for_rule(adamw).lr == 0.2


@pytest.mark.parametrize("algorithm,lr", [(None, 0.1), ("fedadamw", 3e-4)])
def test_a_recipe_without_lr_records_the_rules_own(algorithm, lr, tmp_path):
    recipe = tmp_path / "no_lr.yaml"
    recipe.write_text("\n".join(ln for ln in Path(TINY).read_text().splitlines() if "lr:" not in ln) + "\n")
    kwargs, text = cli._parse("fedlight fit", ["--config", str(recipe), *(["--algorithm", algorithm] if algorithm
                                                                           else [])])
    assert kwargs["loop"].lr == pytest.approx(lr) and f"lr: {lr}" in text

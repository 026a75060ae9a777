"""Seeds and list arguments validated before anything is written, and the messages of issue 68 (items 4 and 10): one
line, exit 2, naming the setting."""

from pathlib import Path

import pytest

from fedlight.config.cli import main

TINY = str(Path(__file__).parent / "configs" / "tiny.yaml")
MAX = 2**32 - 1


def _refused(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("seeds, says", [
    ("", "got '': no seed"), ("-1", "got '-1': '-1' is not a seed"), ("0,,1", "got '0,,1': an empty item"),
    ("x", "got 'x': 'x' is not a seed"), (str(MAX + 1), f"got '{MAX + 1}': '{MAX + 1}' is not a seed"),
    ("1, 2,1", None)])
def test_lockstep_seeds_are_checked_before_anything_is_written(seeds, says, tmp_path, capsys):
    out = tmp_path / "g"
    line = _refused(capsys, ["lockstep", "--config", TINY, "--out_dir", str(out), "--seeds", seeds])
    if says is None:
        assert line == "fedlight lockstep: error: `--seeds 1, 2,1` names seed 1 more than once; each seed runs once"
    else:
        assert line == ("fedlight lockstep: error: `--seeds` takes seeds separated by commas, each a whole number from "
                        f"0 to {MAX} (e.g. 0,1,2); {says}")
    assert not out.exists()  # no empty seed-1 folder


def test_a_seeds_flag_without_a_value_and_an_empty_group_folder(tmp_path, capsys):
    line = _refused(capsys, ["lockstep", "--config", TINY, "--seeds"])
    assert line.endswith("got '': no seed")
    line = _refused(capsys, ["lockstep", "--config", TINY, "--seeds", "0,1", "--out_dir"])
    assert line == ("fedlight lockstep: error: `--out_dir` of a `--seeds` group needs a folder (its runs go to "
                    "FOLDER/seed<k>)")


@pytest.mark.parametrize("seed", ["-1", str(MAX + 1), str(2**64)])
def test_fit_seed_is_checked_before_anything_is_written(seed, tmp_path, capsys):
    out = tmp_path / "run"
    for cmd in (["fit"], ["lockstep"]):
        line = _refused(capsys, [*cmd, "--config", TINY, "--out_dir", str(out), "--seed", seed])
        assert line.endswith(f"error: `seed` must be a whole number from 0 to {MAX}, got {seed}"), line
        assert not out.exists()


def test_fit_from_python_checks_its_seed(tmp_path):
    import fedlight
    from fedlight.errors import ConfigError

    with pytest.raises(ConfigError, match=r"`seed` must be a whole number from 0 to 4294967295, got -3"):
        fedlight.fit({"class_path": "fedlight.models.MLP", "init_args": {"in_features": 60, "num_classes": 10}},
                     fedlight.data.Synthetic(num_clients=4), seed=-3, out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag, value, says", [
    ("--privacy.noise_multiplier", "nan", "`privacy.noise_multiplier` must be a finite number, got nan"),
    ("--privacy.noise_multiplier", "inf", "`privacy.noise_multiplier` must be a finite number, got inf"),
    ("--privacy.noise_multiplier", "abc", "`privacy.noise_multiplier` must be a number, got abc"),
    ("--privacy.bogus", "1", "`privacy.bogus` is not a setting (every `privacy` key: `fedlight fit --help`)"),
    ("--privacy.noise_multipler", "1", "`privacy.noise_multipler` is not a setting; did you mean 'noise_multiplier'? "
                                       "(every `privacy` key: `fedlight fit --help`)"),
    ("--loop.matmul_convs", "1e9", "`loop.matmul_convs` must be a whole number written with digits only, e.g. "
                                   "1000000000; got 1000000000.0"),
    ("--loop.matmul_convs", "2.5", "`loop.matmul_convs` must be a whole number, got 2.5")])
def test_a_bad_value_is_named_by_its_setting(flag, value, says, tmp_path, capsys):
    line = _refused(capsys, ["fit", "--config", TINY, "--out_dir", str(tmp_path / "run"), flag, value])
    assert line == f"fedlight fit: error: {says}"


def test_the_same_values_in_a_recipe_get_the_same_line(tmp_path, capsys):
    for text, says in (("privacy:\n  noise_multiplier: abc\n", "`privacy.noise_multiplier` must be a number, got abc"),
                       ("privacy:\n  bogus: 1\n", "`privacy.bogus` is not a setting")):
        recipe = tmp_path / "r.yaml"
        recipe.write_text(text)
        line = _refused(capsys, ["fit", "--config", TINY, "--config", str(recipe), "--out_dir", str(tmp_path / "x")])
        assert line.startswith(f"fedlight fit: error: {says}"), line


def test_lockstep_streams_empty_is_refused_not_taken_as_auto(capsys, monkeypatch):
    monkeypatch.delenv("FEDLIGHT_LOCKSTEP_STREAMS", raising=False)
    line = _refused(capsys, ["lockstep", "--config", TINY, "--streams", ""])
    assert line == "fedlight lockstep: error: `fedlight lockstep --streams` is one of auto, on, off, got ''"


def test_reproduce_fit_args_name_a_lockstep_flag_as_such():
    from fedlight.errors import ConfigError
    from fedlight.lab.tables.runner import execution_args

    with pytest.raises(ConfigError, match=r"^`--fit-args`: --streams is a `fedlight lockstep` flag, not a `fedlight "
                       r"fit` one; .* \$FEDLIGHT_LOCKSTEP_STREAMS \(auto, on or off\)$"):
        execution_args("--streams bogus")
    assert execution_args("--loop.progress false") == ["--loop.progress", "false"]


def test_a_refused_extension_of_a_spent_target_epsilon_run_prints_no_calibration_it_does_not_use(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["fit", "--config", TINY, "--algorithm", "FedAvg", "--out_dir", str(out), "--loggers", "null",
             "--privacy.target_epsilon", "8"]
    assert main([*flags, "--loop.rounds", "2"]) == 0
    assert "reaches ε = 8" in capsys.readouterr().err  # a fresh run: its calibration, used
    assert main([*flags, "--loop.rounds", "4", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "reaches ε" not in err, err
    assert err.strip().splitlines()[-1].startswith("fedlight fit: error: `privacy.target_epsilon` 8 is spent: the 2 "
                                                   "rounds trained at σ = ")

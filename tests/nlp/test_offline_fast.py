"""Offline fails fast: whatever ``HF_HUB_OFFLINE`` says, a run that needs the Hub (a model or tokenizer name, GLUE
without a local folder) and cannot reach it exits 2 after the reachability probe alone (no download tried, no retry,
no back-off: counted, not timed) with one message naming the local alternative. The network is made unreachable
inside the test: every proxy variable points at a closed local port."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fedtest import waited_on_probes_only

from fedlight.config import cli

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "fedadamw_robertalora_glue_dir0.8.yaml")


@pytest.fixture(params=[None, "0", "1"], ids=["HF_HUB_OFFLINE-unset", "HF_HUB_OFFLINE=0", "HF_HUB_OFFLINE=1"])
def no_network(request, monkeypatch, tmp_path):
    from huggingface_hub import constants

    for var in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # the discard port: nothing listens, connections are refused
    for var in ("NO_PROXY", "no_proxy", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub-cache"))
    if request.param is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", request.param)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", request.param == "1")
    warm_imports()
    return request.param


def warm_imports() -> None:
    """Import what a run imports (seconds on a loaded machine), so the clock measures the run, not Python imports."""
    import lightning  # noqa: F401
    import peft  # noqa: F401
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401

    import fedlight.config.api  # noqa: F401
    import fedlight.data.glue  # noqa: F401
    import fedlight.engine.loop  # noqa: F401

    cli._parser("fedlight fit", docs=False)


def test_the_hub_probe_gives_up_within_its_timeout(no_network):
    from fedlight.models import hub

    t0 = time.perf_counter()
    assert not hub.available() and not hub.reachable()
    assert time.perf_counter() - t0 <= 2 * hub.PROBE_S
    assert hub.download_command("roberta-base") == "hf download roberta-base"  # huggingface_hub >= 0.34 here


def fit(argv, capsys):
    t0 = time.perf_counter()
    code = cli.main(["fit", "--config", RECIPE, "--loop.rounds", "1", "--loop.progress", "false", *argv])
    return code, time.perf_counter() - t0, capsys.readouterr().err


def one_error(err: str) -> str:
    assert "Traceback" not in err and err.count("error:") == 1 and "Retrying" not in err, err
    return err


def test_a_missing_glue_folder_exits_2_fast_naming_the_folder_and_the_download(no_network, model_dir, tmp_path,
                                                                               capsys, network_waits):
    code, took, err = fit(["--model.init_args.name", str(model_dir), "--data.init_args.tokenizer", str(model_dir),
                           "--data.init_args.root", str(tmp_path / "nowhere"), "--out_dir", str(tmp_path / "run")],
                          capsys)
    assert code == 2 and waited_on_probes_only(network_waits), (code, took, network_waits, err)
    one_error(err)
    assert "GLUE RTE not found" in err and str(tmp_path / "nowhere" / "glue" / "RTE") in err
    assert "hf download nyu-mll/glue --repo-type dataset --include 'rte/*'" in err and "datasets" in err


@pytest.mark.parametrize("where", ["--model.init_args.name", "--data.init_args.tokenizer"])
def test_a_hub_name_exits_2_fast_naming_a_local_directory(no_network, where, model_dir, glue_root, tmp_path, capsys,
                                                         network_waits):
    argv = {"--model.init_args.name": str(model_dir), "--data.init_args.tokenizer": str(model_dir)}
    argv[where] = "roberta-base"
    code, took, err = fit([*(x for kv in argv.items() for x in kv), "--data.init_args.root", str(glue_root),
                           "--out_dir", str(tmp_path / "run")], capsys)
    assert code == 2 and waited_on_probes_only(network_waits), (code, took, network_waits, err)
    one_error(err)
    assert "'roberta-base' is a Hugging Face Hub name" in err and "local directory" in err
    assert "`hf download roberta-base --local-dir DIR`" in err
    why = "HF_HUB_OFFLINE is set" if no_network == "1" else "cannot be reached within 3 s"
    assert why in err

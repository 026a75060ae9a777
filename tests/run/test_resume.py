"""Crash safety, divergence handling, client failures and safe loading."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fedtest import image_clients, tiny_cnn

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.core.sampling import client_fails, sample_clients
from fedlight.data import TensorClients
from fedlight.errors import ConfigError

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
ROUNDS = ["--loop.rounds", "4", "--loop.eval_every", "1"]


def _cli(out, *extra, env=None, check=True):
    cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir", str(out), *ROUNDS, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    if check:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def _fit_here(out, *extra):
    """``fedlight fit`` in this process (saves an interpreter start where nothing is killed)."""
    from fedlight.config.cli import main

    assert main(["fit", "--config", TINY, "--out_dir", str(out), *ROUNDS, *extra]) == 0


def _rounds(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["round"] for line in lines]


def _final(out):
    return torch.load(Path(out) / "final_model.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    _fit_here(out)
    return _final(out)


@pytest.mark.parametrize("point", ["train@2", "eval@3", "ckpt@2", "metrics@3"])
def test_sigkill_then_resume_is_bitwise(point, reference, tmp_path):
    out = tmp_path / "run"
    res = _cli(out, env={"FEDLIGHT_FAULT": point}, check=False)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert not (out / "summary.json").exists()
    assert not list((out / "checkpoints").glob(".*.tmp")) or point == "ckpt@2"  # a torn temp file at most
    _fit_here(out, "--resume", "auto")
    assert _rounds(out) == [1, 2, 3, 4]
    final = _final(out)
    for k in reference:
        assert torch.equal(final[k], reference[k]), (point, k)


def _has_a_row(out):
    metrics = Path(out) / "metrics.jsonl"
    return metrics.is_file() and bool(metrics.read_text().strip())


def test_sigkill_at_arbitrary_times(reference, tmp_path):
    """Kill from outside at moments the run does not choose (wherever its threads happen to be), then resume: as its
    run directory appears (start-up) and as its first row appears (rounds and checkpoint writes under way). The moments
    are the run's own, not fixed delays after the interpreter's start, which fell before the run or after its end
    depending on how long the imports took."""
    for name, reached in (("start", Path.exists), ("rounds", _has_a_row)):
        out = tmp_path / f"run-{name}"
        cmd = [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir", str(out), *ROUNDS,
               "--loop.rounds", "6"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not reached(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _fit_here(out, "--loop.rounds", "6", "--resume", "auto")
        assert _rounds(out) == [1, 2, 3, 4, 5, 6]


def _fit(tmp, name, clients, **loop):
    data = TensorClients(clients, test=clients[0], batch_size=4)
    cfg = LoopConfig(**{"rounds": 3, "clients_per_round": 3, "local_steps": 3, "lr": 0.05, "progress": False,
                        **loop})
    s = fedlight.fit(tiny_cnn(), data, fedlight.create("scaffold"), cfg, out_dir=str(tmp / name))
    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines()]
    return s, rows


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path):
    s, rows = _fit(tmp_path, "d", image_clients(), lr=1e30, max_grad_norm=None, rounds=5)
    assert s["diverged_at_round"] is not None
    assert s["rounds_completed"] == s["diverged_at_round"] - 1 == len(rows)
    ckpt_path = tmp_path / "d" / "checkpoints" / "last.ckpt"
    if s["rounds_completed"]:
        ckpt = torch.load(ckpt_path, weights_only=True)
        assert ckpt["round"] == s["rounds_completed"]
        assert all(torch.isfinite(v).all() for v in ckpt["params"].values())
    else:
        assert not ckpt_path.exists()
    assert all(torch.isfinite(v).all() for v in _final(tmp_path / "d").values() if v.is_floating_point())


@pytest.mark.parametrize("parallelism", ["sequential", "vmap"])
def test_skip_client_drops_only_the_bad_client(tmp_path, parallelism):
    clients = image_clients()
    clients[1] = (torch.full_like(clients[1][0], float("nan")), clients[1][1])  # client 1 yields NaN losses
    s, rows = _fit(tmp_path, "s", clients, on_nonfinite="skip_client", rounds=4, client_parallelism=parallelism)
    if parallelism == "vmap":  # the NaN client trained in the same stack leaks into no other client
        _fit(tmp_path, "ref", clients, on_nonfinite="skip_client", rounds=4)
        for k, v in _final(tmp_path / "ref").items():
            torch.testing.assert_close(_final(tmp_path / "s")[k], v, rtol=0, atol=1e-5, msg=k)
    assert "diverged_at_round" not in s
    for r, row in enumerate(rows):
        bad = 1 in sample_clients(4, 3, 0, r)
        assert row["clients_skipped_nonfinite"] == int(bad)
        assert row["clients_reported"] == 3 - int(bad)
    assert all(torch.isfinite(v).all() for v in _final(tmp_path / "s").values() if v.is_floating_point())


def test_client_dropout_is_seeded_and_leaves_state(tmp_path):
    p = 0.5
    s1, rows1 = _fit(tmp_path, "a", image_clients(), client_dropout=p, rounds=4)
    s2, rows2 = _fit(tmp_path, "b", image_clients(), client_dropout=p, rounds=4)
    assert _final(tmp_path / "a").keys() == _final(tmp_path / "b").keys()
    assert all(torch.equal(_final(tmp_path / "a")[k], _final(tmp_path / "b")[k]) for k in _final(tmp_path / "a"))
    for r, row in enumerate(rows1):
        dropped = [c for c in sample_clients(4, 3, 0, r) if client_fails(0, r, c, p)]
        assert row["clients_dropped"] == len(dropped)
    # per-client state: a client that only ever failed has none stored
    ckpt = torch.load(tmp_path / "a" / "checkpoints" / "last.ckpt", weights_only=True)
    reported = {c for r in range(4) for c in sample_clients(4, 3, 0, r) if not client_fails(0, r, c, p)}
    assert set(ckpt["store"]["states"]) | set(ckpt["store"].get("spilled", {})) == reported  # embedded or by file


def test_round_where_nobody_reports_leaves_model_unchanged(tmp_path):
    # find a round in which every sampled client fails
    p = 0.9
    s, rows = _fit(tmp_path, "n", image_clients(), client_dropout=p, rounds=3)
    silent = [r for r in range(3) if all(client_fails(0, r, c, p) for c in sample_clients(4, 3, 0, r))]
    assert silent, "choose p so that at least one round is silent"
    for r in silent:
        assert rows[r]["clients_reported"] == 0
        assert "update_norm" not in rows[r]


def test_truncated_and_foreign_checkpoints_are_refused(tmp_path):
    _fit(tmp_path, "r", image_clients(), rounds=2)
    ckpt = tmp_path / "r" / "checkpoints" / "last.ckpt"
    data = ckpt.read_bytes()
    trunc = tmp_path / "trunc.ckpt"
    trunc.write_bytes(data[: len(data) // 2])
    cfg = LoopConfig(rounds=3, clients_per_round=3, local_steps=3, progress=False)
    with pytest.raises(ConfigError, match="trunc.ckpt is damaged: it is truncated"):
        fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("scaffold"), cfg,
                     out_dir=str(tmp_path / "x"), resume=str(trunc))
    with pytest.raises(ConfigError, match="algorithm is 'scaffold' there and 'fedavg' here"):
        fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("fedavg"), cfg,
                     out_dir=str(tmp_path / "y"), resume=str(ckpt))
    from fedlight.models import SmallCNN

    with pytest.raises(ConfigError, match="does not match this run"):
        fedlight.fit(SmallCNN(1, 3, width=6), TensorClients(image_clients(), batch_size=4),
                     fedlight.create("scaffold"), cfg, out_dir=str(tmp_path / "z"), resume=str(ckpt))


def test_every_load_is_weights_only():
    root = Path(fedlight.__file__).parent
    for f in root.rglob("*.py"):
        for m in re.finditer(r"torch\.load\(([^)]*)\)", f.read_text()):
            assert "weights_only=True" in m.group(1) or "mmap" in m.group(1), f"{f}: {m.group(0)}"


@pytest.mark.parametrize("drift,why", [(["--loop.lr", "0.1"], "loop.lr is 0.05 there and 0.1 here"),
                                        (["--model.init_args.hidden", "[8]"], "shapes is ")])
def test_resume_refuses_drift_exactly_once_with_one_message(tmp_path, capsys, monkeypatch, drift, why):
    """One resume check (the fit driver's): a defining setting or the model's shapes changed since the checkpoint is
    refused by one call of the check, with one message listing the difference, before any file is written."""
    import fedlight.engine.driver
    from fedlight.config.cli import main

    out = str(tmp_path / "run")
    assert main(["fit", "--config", TINY, "--out_dir", out, "--loop.rounds", "1"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()}
    calls = []
    check = fedlight.engine.driver.resume_problems
    monkeypatch.setattr(fedlight.engine.driver, "resume_problems", lambda *a: calls.append(a) or check(*a))
    capsys.readouterr()
    assert main(["fit", "--config", TINY, "--out_dir", out, "--loop.rounds", "2", "--resume", "auto", *drift]) == 2
    err = capsys.readouterr().err
    assert len(calls) == 1
    assert err.count("does not match this run") == 1 and why in err, err
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "run").iterdir()} == before


def test_a_run_recorded_with_the_clip_auto_stands_for_keeps_its_name_and_resumes_under_auto(tmp_path, capsys,
                                                                                           monkeypatch):
    """``loop.max_grad_norm`` is defining as the clip it resolves to: a run recorded with ``10.0`` (fedlight's models'
    default before ``auto``) has the directory name a default run gets, resumes under the default bitwise equal to an
    uninterrupted run, and another clip is still refused. A LightningModule's ``auto`` is no clip."""
    from fedlight.config.cli import main
    from fedlight.config.settings import resolve_clip
    from fedlight.run.directory import differences

    def fit(cwd, *extra):
        monkeypatch.chdir(cwd)
        return main(["fit", "--config", TINY, "--loop.rounds", "3", *extra])

    (tmp_path / "old").mkdir(), (tmp_path / "new").mkdir()
    assert fit(tmp_path / "new") == 0  # default: auto
    assert fit(tmp_path / "old", "--loop.rounds", "2", "--loop.max_grad_norm", "10") == 0
    assert fit(tmp_path / "old", "--resume", "auto") == 0  # the default finds the directory and continues it
    old, new = [list((tmp_path / d / "runs").iterdir()) for d in ("old", "new")]
    assert len(old) == 1 and [p.name for p in old] == [p.name for p in new]
    assert _rounds(old[0]) == [1, 2, 3]
    a, b = _final(old[0]), _final(new[0])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    assert fit(tmp_path / "old", "--loop.rounds", "4", "--resume", str(old[0] / "checkpoints" / "last.ckpt"),
               "--loop.max_grad_norm", "5", "--out_dir", str(old[0])) == 2
    assert "loop.max_grad_norm is 10.0 there and 5.0 here" in capsys.readouterr().err
    key = "loop.max_grad_norm"
    assert resolve_clip({key: "auto"}, lightning=False) == {key: 10.0}
    assert resolve_clip({key: "auto"}, lightning=True) == {key: None}
    assert resolve_clip({key: 3.0}, lightning=True) == {key: 3.0}
    assert differences({key: "auto"}, {key: None}) == [] and differences({key: "auto"}, {key: 10.0}) == []
    assert differences({key: None}, {key: 10.0}) == ["loop.max_grad_norm is None there and 10.0 here"]

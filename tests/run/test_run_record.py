"""The run record: what a run writes and prints (issue 11 RunRecord + seeding, issue 12 background checkpoints,
issue 13 item 7, issue 15 items 4-5 and the exploding-loss warning)."""

import contextlib
import io
import json
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fedtest import image_clients, tiny_cnn

import fedlight
from fedlight.core.loop_config import LoopConfig
from fedlight.core.sampling import sample_clients
from fedlight.data import Synthetic, TensorClients
from fedlight.run import atomic as records
from fedlight.run.console import Progress
from fedlight.run.record import RunRecord

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
MLP_SPEC = {"class_path": "fedlight.models.MLP", "init_args": {"in_features": 60, "hidden": [16], "num_classes": 10}}


def _rows(out):
    return [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _strict_json(line):
    def refuse(c):
        raise ValueError(f"non-strict JSON constant {c}")

    return json.loads(line, parse_constant=refuse)


def _cli(*args):
    """``fedlight fit`` in this process (saves an interpreter start); stderr, a pipe-like stream, not a terminal."""
    from fedlight.config.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["fit", "--config", TINY, *map(str, args)])
    res = SimpleNamespace(returncode=code, stderr=err.getvalue())
    assert res.returncode == 0, res.stderr[-3000:]
    return res


# ---------------------------------------------------------------------------------------- seeding (issue 11 item 5)
def test_python_api_and_cli_build_the_same_model_and_record_it(tmp_path):
    _cli("--out_dir", tmp_path / "cli", "--loop.rounds", 2)
    from fedlight.algorithms import SCAFFOLD

    torch.manual_seed(1234)  # whatever the caller's global RNG holds, fit seeds before building the model
    fedlight.fit(MLP_SPEC, Synthetic(alpha=1.0, beta=1.0, num_clients=6, batch_size=10, max_samples=200), SCAFFOLD(),
                 LoopConfig(rounds=2, clients_per_round=4, local_steps=5, lr=0.05, progress=False),
                 out_dir=str(tmp_path / "py"), accelerator="cpu")
    a = torch.load(tmp_path / "cli" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "py" / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    import yaml

    cfg = yaml.safe_load((tmp_path / "py" / "config.yaml").read_text())
    assert cfg["model"] == MLP_SPEC
    assert cfg["data"]["init_args"]["max_samples"] == 200  # data modules remember their constructor arguments
    from fedlight.lab.flatness.run import load_run

    run = load_run(tmp_path / "py", device="cpu")  # landscape / sharpness rebuild the Python-API run
    assert all(torch.equal(run.model.state_dict()[k], b[k]) for k in b)


# ---------------------------------------------------------------------------------------- metrics (issue 15 item 5)
def test_rows_carry_sampled_clients_and_tensorboard_histograms(tmp_path):
    out = tmp_path / "run"
    data = TensorClients(image_clients(), batch_size=4)
    fedlight.fit(tiny_cnn(), data, fedlight.create("fedavg"),
                 LoopConfig(rounds=2, clients_per_round=3, local_steps=2, progress=False), out_dir=str(out))
    for r, row in enumerate(_rows(out)):
        assert row["sampled"] == sample_clients(4, 3, 0, r)
        assert [c["id"] for c in row["clients"]] == row["sampled"]
        for c in row["clients"]:
            assert c["num_samples"] == data.num_samples(c["id"]) and c["delta_norm"] > 0 and c["train_loss"] > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"), size_guidance={"histograms": 0})
    ea.Reload()
    assert {"clients/train_loss", "clients/delta_norm", "clients/num_samples"} <= set(ea.Tags()["histograms"])
    assert [h.step for h in ea.Histograms("clients/delta_norm")] == [1, 2]


# ---------------------------------------------------------------------------------------- strict JSON (issue 13 item 7)
def test_nan_test_loss_is_null_with_a_flag(tmp_path):
    clients = image_clients()
    test = (torch.full_like(clients[0][0], float("nan")), clients[0][1])
    out = tmp_path / "run"
    s = fedlight.fit(tiny_cnn(), TensorClients(clients, test=test, batch_size=4), fedlight.create("fedavg"),
                     LoopConfig(rounds=2, clients_per_round=3, local_steps=2, progress=False), out_dir=str(out))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [_strict_json(x) for x in lines]
    assert all(r["test_loss"] is None and "test_loss" in r["nonfinite"] for r in rows)
    assert _strict_json((out / "summary.json").read_text())["final_test_loss"] is None
    assert s["final_test_loss"] is None


# ---------------------------------------------------------------------------------------- progress (issue 15 item 4)
def test_progress_lines_without_a_terminal(tmp_path):
    res = _cli("--out_dir", tmp_path / "run", "--loop.rounds", 3, "--loop.progress", "true")
    lines = [x for x in res.stderr.splitlines() if x.startswith("round ")]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"]
    assert all("test_acc" in x and "train_loss" in x and "s/round" in x and "ETA" in x for x in lines)


class _TTY(io.StringIO):
    def isatty(self):
        return True


def test_terminal_bar_shows_the_phase():
    p = Progress(5, stream=_TTY())
    p.start(0, [])
    p.phase("evaluating", 0)
    assert "evaluating" in p.bar.desc
    p.update({"round": 1, "round_time_s": 0.1, "test_acc": 0.5})
    p.phase("training", 1)
    assert "round 2 training" in p.bar.desc
    p.close()


def test_exploding_train_loss_warns_once_with_the_likely_cause(tmp_path, capsys):
    from fedlight.algorithms import FedAdamW
    from fedlight.config.settings import lr_hint as _lr_hint

    hint = _lr_hint(FedAdamW(), LoopConfig(lr=0.1))
    assert "`loop.lr` = 0.1" in hint and "FedAdamW" in hint
    rec = RunRecord(tmp_path, rounds=4, progress=False, hint=hint)
    rec.begin(0, None)
    for r, loss in enumerate([2.3, 2.0, 93.9, math.nan], start=1):
        rec.round_done({"round": r, "train_loss": loss})
    rec.close()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "round 3 train loss 93.9" in err and "`loop.lr` = 0.1" in err


def test_the_divergence_hint_names_the_causes_of_the_run_at_hand():
    """An SGD run's warning blamed the learning rate 'for adaptive optimizers such as Adam/AdamW' and suggested lr/100;
    a private run's, not the noise that made it diverge (the README's DP line: train loss 0.65 -> 159)."""
    from fedlight.algorithms import FedAvg
    from fedlight.config.settings import lr_hint as _lr_hint
    from fedlight.privacy.settings import PrivacyConfig

    sgd = _lr_hint(FedAvg(), LoopConfig(lr=0.05))
    assert sgd == ("the learning rate `loop.lr` = 0.05 is too large for the local optimizer torch.optim.SGD; lower it, "
                   "e.g. `--loop.lr 0.005`")
    adam = _lr_hint(FedAvg(), LoopConfig(lr=0.1, optimizer="torch.optim.AdamW"))
    assert "Adam/AdamW usually take ~1e-3" in adam and "`--loop.lr 0.001`" in adam
    private = _lr_hint(FedAvg(), LoopConfig(lr=0.05), PrivacyConfig(target_epsilon=8.0, delta=1e-3))
    assert private.startswith("the privacy noise outweighs the clipped updates (σ·C/m per coordinate of the mean ")
    assert private.endswith("; or " + sgd) and "Adam" not in private
    record = _lr_hint(FedAvg(), LoopConfig(lr=0.05), PrivacyConfig(level="record", noise_multiplier=1.0))
    assert record.startswith("the DP-SGD noise") and record.endswith(sgd)


# ---------------------------------------------------------------------------------------- background checkpoints
def test_next_round_runs_while_the_checkpoint_is_written(tmp_path, monkeypatch):
    """Checkpoint r's write waits until round r+1 has started: it completes only if the loop did not wait for it.
    Also: at most one write in flight, and round r's metrics line lands only after checkpoint r is renamed."""
    from fedlight.engine.loop import FederatedLoop

    started = {r: threading.Event() for r in range(1, 5)}
    round_steps = FederatedLoop.round_steps  # what the fit driver calls for each round (run_round drives it alone)

    def spy_round(self, r):
        started[r + 1].set()
        return round_steps(self, r)

    out, seen, in_flight = tmp_path / "run", [], []
    save = records.atomic_torch_save

    def done_rounds():
        return [row["round"] for row in _rows(out)] if (out / "metrics.jsonl").exists() else []

    def slow_save(obj, path, before_replace=None, previous=None):
        if path.name != "last.ckpt":
            return save(obj, path, before_replace, previous)
        in_flight.append(1)
        r = obj["round"]
        seen.append((r, len(in_flight), started[r + 1].wait(60) if r < 3 else True))
        assert r not in done_rounds()  # the row follows its checkpoint
        save(obj, path, before_replace, previous)
        in_flight.pop()

    monkeypatch.setattr(FederatedLoop, "round_steps", spy_round)
    monkeypatch.setattr(records, "atomic_torch_save", slow_save)
    fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("scaffold"),
                 LoopConfig(rounds=3, clients_per_round=3, local_steps=2, progress=False), out_dir=str(out))
    assert seen == [(1, 1, True), (2, 1, True), (3, 1, True)]
    assert [r["round"] for r in _rows(out)] == [1, 2, 3]
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["round"] == 3


def test_snapshot_is_a_private_copy(tmp_path):
    """The background write reads a snapshot: changing the model afterwards does not change what is written."""
    from fedtest import linear_model, make_loop, problem

    clients, theta = problem()
    loop = make_loop(fedlight.create("fedavg"), clients, linear_model(theta), out_dir=tmp_path)
    loop.run_round(0)
    snap = loop.state.snapshot()
    before = {k: v.clone() for k, v in snap["params"].items()}
    for v in loop.x.values():
        v.add_(1.0)
    assert all(torch.equal(snap["params"][k], before[k]) for k in before)


def test_unchanged_client_state_is_never_rewritten(tmp_path, monkeypatch):
    """Each checkpoint writes the states of the round's reporting clients only; the others stay referenced."""
    from fedlight.engine.client_store import ClientStateStore

    writes = []
    write = ClientStateStore._write

    def spy(self, client_id, state):
        writes.append(client_id)
        return write(self, client_id, state)

    monkeypatch.setattr(ClientStateStore, "_write", spy)
    out = tmp_path / "run"
    fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("scaffold"),
                 LoopConfig(rounds=4, clients_per_round=2, local_steps=2, progress=False), out_dir=str(out))
    reported = [c["id"] for row in _rows(out) for c in row["clients"]]
    assert sorted(writes) == sorted(reported) and len(writes) == 4 * 2
    ckpt = torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["store"]["states"] == {} and set(ckpt["store"]["spilled"]) == set(reported)


def test_python_api_records_algorithm_hyperparameters_and_resume_compares_them(tmp_path):
    import yaml

    from fedlight.algorithms import FedNSAM
    from fedlight.errors import ConfigError

    def run(rho, **kw):
        return fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), FedNSAM(rho=rho),
                            LoopConfig(rounds=2, clients_per_round=2, local_steps=1, progress=False),
                            out_dir=str(tmp_path / "run"), **kw)

    run(0.2)
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["algorithm"]["init_args"] == {"rho": 0.2}
    with pytest.raises(ConfigError, match="algorithm.init_args.rho is 0.2 there and 0.1 here"):
        run(0.1, resume="auto")


def test_a_failed_background_write_is_one_message(tmp_path, monkeypatch):
    import errno

    from fedlight.errors import ConfigError

    def full(obj, path, before_replace=None, previous=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records, "atomic_torch_save", full)
    with pytest.raises(ConfigError, match="cannot write .*last.ckpt: No space left on device"):
        fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("fedavg"),
                     LoopConfig(rounds=2, clients_per_round=2, local_steps=1, progress=False),
                     out_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run" / ".fedlight.lock").exists()  # the lock is released


def test_an_unregistered_algorithm_subclass_records_its_arguments():
    """``Algorithm.__init_subclass__`` wraps every subclass, registered or not (a user's own rule in a script)."""
    from fedlight.core.rules import Algorithm, ServerRule
    from fedlight.core.spec import describe

    class Mine(Algorithm):
        def __init__(self, server_lr: float = 1.0, note: str = "x") -> None:
            super().__init__(server=ServerRule(server_lr))

    spec = describe(Mine(server_lr=0.5))
    assert spec["init_args"] == {"server_lr": 0.5}


# ---------------------------------------------------------------------------------------- one s/round (issue 19)
def test_console_and_summary_share_one_seconds_per_round(tmp_path):
    """Both labelled parts, training and with evaluation, are the same numbers on the console and in summary.json:
    means over rounds 2..R, the first (warm-up) round given apart."""
    out = tmp_path / "run"
    res = _cli("--out_dir", out, "--loop.rounds", 3, "--loop.progress", "true")
    last = [x for x in res.stderr.splitlines() if x.startswith("round 3/3")][0]
    s = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("warm_up", False) for r in rows] == [True, False, False]
    train = sum(r["round_time_s"] for r in rows[1:]) / 2
    wait = train + sum(r.get("eval_time_s", 0) + r.get("checkpoint_time_s", 0) for r in rows[1:]) / 2
    assert s["seconds_per_round"] == pytest.approx(train, rel=1e-12)
    assert s["seconds_per_round_with_eval"] == pytest.approx(wait, rel=1e-12) and wait > train
    assert s["warm_up_round_s"] == pytest.approx(rows[0]["round_time_s"], rel=1e-12)
    assert f"s/round {s['seconds_per_round']:.3f} training, {s['seconds_per_round_with_eval']:.3f} with eval" in last


def test_seconds_per_round_leaves_out_warm_up_rounds_on_console_and_in_summary():
    """The H100 run of the GPU check: a 26 s compiling first round, then 1.6 s rounds. The console (after 30
    rounds, and after a resume that warmed up again) and the summary give the same steady mean, 1.6 s."""
    import io

    from fedlight.run.console import Progress
    from fedlight.run.files import seconds_per_round, summarize

    rows = [{"round": r, "round_time_s": 26.0 if r in (1, 21) else 1.6, "eval_time_s": 0.05, "test_acc": 0.3,
             **({"warm_up": True} if r in (1, 21) else {})} for r in range(1, 31)]
    assert seconds_per_round(rows) == (pytest.approx(1.6), pytest.approx(1.65))
    s = summarize(rows, [], {})
    assert (s["seconds_per_round"], s["warm_up_round_s"]) == (pytest.approx(1.6), pytest.approx(26.0))
    buf = io.StringIO()
    p = Progress(30, stream=buf)
    p.start(20, rows[:20])  # resumed after round 20; its own first round (21) is a warm-up again
    for row in rows[20:]:
        p.update(row)
    assert "round 30/30" in buf.getvalue().splitlines()[-1]
    assert "s/round 1.600 training, 1.650 with eval" in buf.getvalue().splitlines()[-1]
    assert seconds_per_round(rows[:1]) == (pytest.approx(26.0), pytest.approx(26.05))  # nothing else: the warm-up

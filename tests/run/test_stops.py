"""Clean stops (issue 22): a signal or a failed write ends a real ``fedlight fit`` at a safe point with one line and a
documented exit status, and ``--resume auto`` then ends bit for bit where an uninterrupted run ends."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fedtest import image_clients, tiny_cnn

from fedlight.core.loop_config import LoopConfig
from fedlight.data import TensorClients
from fedlight.run import faults, stops

TINY = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
FLAGS = ["--loop.rounds", "5", "--loop.eval_every", "1", "--loop.save_every", "3"]  # checkpoint at 3 and 5


def _cmd(out, *extra):
    return [sys.executable, "-m", "fedlight.config.cli", "fit", "--config", TINY, "--out_dir", str(out), *FLAGS, *extra]


def _cli(out, *extra):
    """``fedlight fit`` in this process, as ``fedlight fit`` would run (no signal is sent): its exit status."""
    from fedlight.config.cli import main

    return main(["fit", "--config", TINY, "--out_dir", str(out), *FLAGS, *extra])


def _rounds(out):
    return [json.loads(line)["round"] for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _final(out):
    return torch.load(Path(out) / "final_model.pt", weights_only=True)


def _ckpt_round(out):
    return torch.load(Path(out) / "checkpoints" / "last.ckpt", weights_only=True)["round"]


def _fit_here(out, *extra):
    """``fedlight fit`` in this process (saves an interpreter start where no signal is sent)."""
    from fedlight.config.cli import main

    assert main(["fit", "--config", TINY, "--out_dir", str(out), *FLAGS, *extra]) == 0


def _assert_same(out, reference):
    _fit_here(out, "--resume", "auto")
    assert _rounds(out) == [1, 2, 3, 4, 5]
    final = _final(out)
    assert all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "run"
    _fit_here(out)
    return _final(out)


def _lines(out):
    path = Path(out) / "metrics.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


def _stop(out, name, round, *extra):
    """Start (or resume) a real ``fedlight fit`` that waits inside ``round`` for a stop signal; send the signal once
    metrics.jsonl has a line and the run waits; return stderr."""
    ready = Path(out).parent / f"paused{round}"
    env = {**os.environ, "FEDLIGHT_FAULT": f"train@{round}:pause", "FEDLIGHT_FAULT_READY": str(ready)}
    proc = subprocess.Popen(_cmd(out, "--resume", "auto", *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + 600  # a bound on a hang only (two processes on a loaded machine took over 120 s)
    while not (_lines(out) and ready.exists()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(getattr(signal, name))
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 128 + getattr(signal, name), err
    return err


def test_signals_stop_after_the_round_write_its_checkpoint_and_resume_bitwise(reference, tmp_path):
    """SIGTERM in round 2, SIGINT in round 3 of the resumed run, SIGUSR1 in round 4 of the next: each stops after
    its round, writes its checkpoint (due under `save_every: 3` only at round 3) and exits 128 + signal; the last
    resume equals a run that never stopped."""
    out = tmp_path / "run"
    for round, name in ((2, "SIGTERM"), (3, "SIGINT"), (4, "SIGUSR1")):
        err = _stop(out, name, round)
        assert err.strip().splitlines()[-1] == \
            f"fedlight: stopped at round {round} by {name}; continue with --resume auto"
        assert "Traceback" not in err
        assert _ckpt_round(out) == round and _rounds(out) == list(range(1, round + 1))
        assert not list((out / "checkpoints").glob(".*.tmp")) and not (out / "summary.json").exists()
        assert not (out / ".fedlight.lock").exists()
    _assert_same(out, reference)


def test_a_signal_to_one_of_two_processes_stops_both_after_the_same_round(reference, tmp_path):
    """`--devices 2`: SIGTERM reaches rank 0 only (rank 1 is its child); the processes agree after the round and
    both stop; the run then resumes on one process and ends where the uninterrupted run ends."""
    out = tmp_path / "run"
    err = _stop(out, "SIGTERM", 2, "--devices", "2", "--accelerator", "cpu")
    assert err.count("stopped at round 2 by SIGTERM") == 1 and "Traceback" not in err, err
    assert _ckpt_round(out) == 2 and _rounds(out) == [1, 2]
    _assert_same(out, reference)


def test_a_full_disk_is_one_message_naming_the_file_and_the_last_checkpoint(reference, tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    monkeypatch.setenv("FEDLIGHT_FAULT", "ckpt@3:enospc")
    code = _cli(out, "--loop.save_every", "1")
    err = capfd.readouterr().err
    assert code == stops.DISK_FAILED == 74, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and "Exception in thread" not in err
    assert lines[-1] == (f"fedlight fit: error: cannot write {out / 'checkpoints' / 'last.ckpt'}: No space left on "
                         "device. Free space or fix the folder, then continue with `--resume auto`. The last "
                         f"complete checkpoint is {out / 'checkpoints' / 'last.ckpt'} (round 2).")
    assert _ckpt_round(out) == 2 and not list((out / "checkpoints").glob(".*.tmp"))
    monkeypatch.delenv("FEDLIGHT_FAULT")
    _assert_same(out, reference)


def _small_fs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_really_full_filesystem_stops_every_thread_quietly(tmp_path, capfd):
    """The trial of the issue: out_dir on a tiny file system (needs root and tmpfs; CI runs the injected test above).
    TensorBoard's thread, the checkpoint thread and the main thread all fail; one message, exit 74, then a resume
    after freeing space equals an uninterrupted run."""
    small = tmp_path / "small"
    if not _small_fs(small, "200k"):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        out, flags = small / "run", ["--loop.rounds", "60", "--loop.save_every", "1"]
        code = _cli(out, *flags)
        err = capfd.readouterr().err
        assert code == 74, err[-3000:]
        assert "Traceback" not in err and "Exception in thread" not in err, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"fedlight fit: error: cannot write {out}") and "No space left on device" in last
        done = _ckpt_round(out)
        assert f"The last complete checkpoint is {out / 'checkpoints' / 'last.ckpt'} (round {done})." in last
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        _fit_here(out, *flags, "--resume", "auto")
        ref = tmp_path / "ref"
        _fit_here(ref, *flags)
        assert _rounds(out) == list(range(1, 61))
        assert all(torch.equal(_final(out)[k], v) for k, v in _final(ref).items())
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_removed_run_directory_is_one_error_and_no_thread_traceback(tmp_path, monkeypatch, capfd):
    import fedlight.engine.loop

    out = tmp_path / "run"
    real = fedlight.engine.loop.fault

    def remove_at_round_3(point, round):
        if (point, round) == ("train", 3) and out.exists():
            for drain in list(faults.DRAIN):  # round 2's writes are done: nothing recreates files meanwhile
                drain()
            shutil.rmtree(out)
        real(point, round)

    monkeypatch.setattr(fedlight.engine.loop, "fault", remove_at_round_3)
    with pytest.raises(stops.RunDirError) as e:
        fedlight.fit(tiny_cnn(), TensorClients(image_clients(), batch_size=4), fedlight.create("fedavg"),
                     LoopConfig(rounds=4, clients_per_round=2, local_steps=1, progress=False), out_dir=str(out))
    assert e.value.status == 74
    assert str(e.value).startswith(f"cannot write {out}")
    assert "which is gone: the run starts over" in str(e.value)  # TensorBoard or the checkpoint writer fails first
    assert not out.exists()  # not made again, half empty
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_the_exit_statuses_are_in_the_help(capsys):
    from fedlight.config.cli import main

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "74 a write to the run directory failed during the run" in text
    assert "130/138/143 stopped by SIGINT/SIGUSR1/SIGTERM" in text
    assert [128 + int(getattr(signal, s)) for s in stops.STOP_SIGNALS] == [143, 130, 138]

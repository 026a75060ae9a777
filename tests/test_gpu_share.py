"""Many runs of a table on one GPU (``fedlight reproduce --per-gpu N|auto``, :mod:`fedlight.lab.tables.gpu_share`): how
many and why, what the processes share, the first run alone until its first round, seed 0 of every cell first, the
table's throughput line, the GPU memory bound and its message. The GPU is faked (no CUDA needed)."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest
from test_reproduce import write_spec

from fedlight.config.cli import main
from fedlight.config.launch import bound_gpu_memory
from fedlight.errors import ConfigError
from fedlight.lab.tables import gpu_share, runner


def test_auto_is_bounded_by_runs_cores_and_memory():
    n, why = gpu_share.choose("auto", runs=27, cores=16, gpu_gib=79.2)
    assert n == 16 and "bounded by the CPU cores" in why and "27 runs to do" in why
    assert gpu_share.choose("auto", runs=9, cores=16, gpu_gib=79.2)[0] == 9
    n, why = gpu_share.choose("auto", runs=27, cores=16, gpu_gib=9.0)
    assert n == 4 and "GPU memory" in why.split("bounded by")[1]
    assert gpu_share.choose(3, runs=27, cores=16, gpu_gib=0) == (3, "--per-gpu 3")
    assert gpu_share.parse_per_gpu("auto") == "auto" and gpu_share.parse_per_gpu("4") == 4
    for bad in ("0", "many", "-2"):
        with pytest.raises(ConfigError, match="--per-gpu"):
            gpu_share.parse_per_gpu(bad)


def test_share_env_splits_threads_and_shares_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_share, "cpu_cores", lambda: 16)
    env, line = gpu_share.share_env({"FEDLIGHT_CACHE": str(tmp_path)}, 4)
    assert env["OMP_NUM_THREADS"] == env["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor") and env["FEDLIGHT_CACHE"] == str(tmp_path)
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1" and float(env[gpu_share.FRACTION_ENV]) == pytest.approx(0.2375)
    assert "bounded to 0.2375 of the card" in line and f"data cache {tmp_path} shared" in line
    kept, _ = gpu_share.share_env({"OMP_NUM_THREADS": "2", gpu_share.FRACTION_ENV: "0.5"}, 4)  # given values win
    assert kept["OMP_NUM_THREADS"] == "2" and kept[gpu_share.FRACTION_ENV] == "0.5"
    assert gpu_share.FRACTION_ENV not in gpu_share.share_env({}, 1)[0]  # one run alone: the whole card


def test_memory_bound_is_checked_and_only_on_cuda(tmp_path):
    import torch

    assert bound_gpu_memory(torch.device("cpu"), {gpu_share.FRACTION_ENV: "0.25"}) is None
    assert bound_gpu_memory(SimpleNamespace(type="cuda"), {}) is None
    with pytest.raises(ConfigError, match="FEDLIGHT_GPU_MEMORY_FRACTION must be a number in \\(0, 1\\]"):
        bound_gpu_memory(SimpleNamespace(type="cuda"), {gpu_share.FRACTION_ENV: "1.5"})
    log = tmp_path / "fit.log"
    log.write_text("round 3\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    hint = gpu_share.memory_hint(log, "0.0594")
    assert "out of GPU memory (its share: 0.0594 of the card" in hint and "smaller --per-gpu" in hint
    log.write_text("ValueError: something else\n")
    assert gpu_share.memory_hint(log, "0.0594") == "" and gpu_share.memory_hint(tmp_path / "none.log") == ""


def test_per_gpu_auto_packs_the_table_first_run_alone_seed_zero_first(tmp_path, monkeypatch, capsys):
    import torch

    spec = write_spec(tmp_path / "quick.yaml")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda g: SimpleNamespace(total_memory=3 * 2**30))
    monkeypatch.setattr(gpu_share, "cpu_cores", lambda: 8)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch sets it once inductor was imported
    monkeypatch.setenv("FEDLIGHT_CACHE", str(tmp_path / "cache"))
    starts, lock, lead_done = [], threading.Lock(), threading.Event()

    def fake_fit(children, cmd, stdout, stderr, env):  # three "rounds" into metrics.jsonl, the first slowly
        out = cmd[cmd.index("--out_dir") + 1]
        with lock:
            starts.append((out.split("/")[-3], cmd[cmd.index("--seed") + 1], lead_done.is_set(), dict(env)))
        first = len(starts) == 1
        for r in range(3):
            time.sleep(0.3 if first else 0.01)
            if first:  # before the row that opens the gate: a run the gate let through always sees it set
                lead_done.set()
            with open(f"{out}/metrics.jsonl", "a") as f:
                f.write(f'{{"round": {r}}}\n')
        return 0

    monkeypatch.setattr(runner.Children, "call", fake_fit)
    main(["reproduce", str(spec), "--seeds", "2", "--per-gpu", "auto", "--lockstep", "off",
          "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    # 4 runs to do, 8 cores, 3 GiB = 1 slice of 2 GiB: one at a time, and it says why
    assert "1 run(s) at a time on each of 1 GPU(s) (--per-gpu auto: 4 runs to do, 8 CPU cores" in out
    assert "bounded by the 2 GiB slices of GPU memory" in out
    assert [(row, seed) for row, seed, *_ in starts] == [("fedavg", "0"), ("fedprox", "0"), ("fedavg", "1"),
                                                         ("fedprox", "1")]  # seed 0 of every cell first
    assert re.search(r"4 runs in \d+ s: 4 failed; 12 rounds, [\d.]+ rounds/s of the table \(1 at a time\)", out)
    starts.clear()
    lead_done.clear()
    main(["reproduce", str(spec), "--seeds", "2", "--per-gpu", "4", "--lockstep", "off", "--out", str(tmp_path / "p")])
    assert [s[2] for s in starts] == [False, True, True, True]  # the others only after the first's first round
    env = starts[0][3]
    assert env["OMP_NUM_THREADS"] in ("1", "2") and float(env[gpu_share.FRACTION_ENV]) == pytest.approx(0.2375)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor") and all(s[3] == env for s in starts)


def test_first_run_gate_opens_on_a_new_round_also_after_a_cut(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n')
    gate = gpu_share.FirstRun(tmp_path)
    assert not gate.open()
    m.write_text('{"round": 1}\n{"round": 2}\n')  # resumed from the checkpoint of round 2: round 3 cut
    assert not gate.open()
    m.write_text('{"round": 1}\n{"round": 2}\n{"round": 3}\n')  # its first round since the start
    assert gate.open()
    fresh = gpu_share.FirstRun(tmp_path / "none")
    assert not fresh.open()
    fresh.ended = True  # the run ended before a round (failed): nobody waits for it
    assert fresh.open()

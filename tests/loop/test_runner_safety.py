"""The stacked default cannot break a run: a failed compilation falls back (eager stacked, else sequential), an
out-of-memory chunk is halved and redone with the numbers of a smaller chunk, ``vmap_chunk: auto`` sizes chunks."""

import pytest
import torch
from fedtest import contract_loop, image_clients, make_loop, tiny_cnn

import fedlight
from fedlight.core import params as P
from fedlight.core.loop_config import LoopConfig
from fedlight.errors import ConfigError
from fedlight.runners import guard
from fedlight.runners.forward import StackedForward


def _rounds(loop, n=2):
    return [loop.run_round(r)["train_loss"] for r in range(n)]


def _same(a, b):
    for k in a.x:
        assert torch.equal(a.x[k], b.x[k]), k
    for k in a.buffers:
        assert torch.equal(a.buffers[k], b.buffers[k]), k


class ReluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(64, 8), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1))))


def test_a_failing_compiler_falls_back_to_eager_stacked(capsys):
    """A real backend failure while compiling: torch's own test backend that refuses graphs with ``torch.relu``."""
    torch._dynamo.reset()
    eager = contract_loop("fedavg", client_parallelism="vmap", compile=False, model=ReluNet())
    comp = contract_loop("fedavg", client_parallelism="vmap", compile="relu_compile_error_TESTING_ONLY",
                         model=ReluNet())
    assert comp.runner.forward.compiled
    assert _rounds(comp) == _rounds(eager)
    _same(comp, eager)
    assert comp.runner.description == "stacked, eager" and len(comp.runner.fallbacks) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "torch.compile of the stacked step failed" in line]
    assert len(lines) == 1 and "--loop.compile false" in lines[0] and "client_parallelism sequential" in lines[0]
    assert "compiling the stacked step (first round only" in err


def test_eager_stacked_failing_too_falls_back_to_sequential(monkeypatch, capsys):
    def broken(self, *a, **k):
        raise RuntimeError("no stacked kernel for this op\nsecond line")

    seq = contract_loop("scaffold", client_parallelism="sequential")
    comp = contract_loop("scaffold", client_parallelism="vmap", compile="aot_eager")
    monkeypatch.setattr(StackedForward, "__call__", broken)
    assert _rounds(comp, 3) == _rounds(seq, 3)
    _same(comp, seq)
    assert comp.runner.name == "sequential" and len(comp.runner.fallbacks) == 2
    assert "RuntimeError: no stacked kernel for this op)" in capsys.readouterr().err


def test_an_error_of_forced_eager_stacked_is_not_swallowed(monkeypatch):
    loop = contract_loop("fedavg", client_parallelism="vmap", compile=False)
    monkeypatch.setattr(StackedForward, "__call__", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        loop.run_round(0)


def _oom_above(limit, calls):
    real = StackedForward.__call__

    def forward(self, params, buffers, batch, objective):
        C = next(iter(params.values())).shape[0]
        calls.append(C)
        if C > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, params, buffers, batch, objective)
    return forward


def test_out_of_memory_halves_the_chunk_with_the_numbers_of_a_smaller_chunk(monkeypatch, capsys):
    clients = image_clients(num_clients=6)
    kw = dict(rounds=2, local_steps=3, batch_size=4, clients_per_round=5, client_parallelism="vmap",
              precision="32-true")
    small = make_loop(fedlight.create("fedsam"), clients, tiny_cnn(), vmap_chunk=2, **kw)
    rows_small = [small.run_round(r) for r in range(2)]
    calls = []
    big = make_loop(fedlight.create("fedsam"), clients, tiny_cnn(), **kw)  # a whole group: 5 clients
    monkeypatch.setattr(StackedForward, "__call__", _oom_above(2, calls))
    rows_big = [big.run_round(r) for r in range(2)]
    assert calls[0] == 5 and 3 in calls and max(calls[calls.index(3) + 1:]) <= 2  # 5 → 3 → 2, then 2 from then on
    assert [r["train_loss"] for r in rows_big] == [r["train_loss"] for r in rows_small]
    assert [c["delta_norm"] for c in rows_big[1]["clients"]] == [c["delta_norm"] for c in rows_small[1]["clients"]]
    _same(big, small)
    assert big.runner.chunk == 2
    assert capsys.readouterr().err.count("out of memory with") == 1


def test_one_client_out_of_memory_is_one_message_with_the_fixes(monkeypatch):
    stacked = contract_loop("fedavg", client_parallelism="vmap")
    monkeypatch.setattr(StackedForward, "__call__", _oom_above(0, []))
    with pytest.raises(guard.OutOfMemory, match=r"client \d+ with the stacked runner.*batch_size.*bf16-mixed.*"
                                                r"vmap_chunk"):
        stacked.run_round(0)
    seq = contract_loop("fedavg", client_parallelism="sequential")

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(seq.local, "step", oom)
    with pytest.raises(guard.OutOfMemory, match=r"sequential runner; fixes: .*bf16-mixed"):
        seq.run_round(0)


def test_auto_chunk_rule():
    assert guard.auto_chunk(free=1000, per_client=100, clients=10, headroom=0.6) == 6
    assert guard.auto_chunk(free=1000, per_client=100, clients=4, headroom=0.6) == 4
    assert guard.auto_chunk(free=10, per_client=100, clients=4) == 1


def test_auto_chunk_measures_the_footprint(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))
    from fedlight.core.rules import cross_entropy

    act = guard.activation_bytes(model, (x, y), cross_entropy)
    # saved for backward: the flattened input 8×64, the first layer's output 8×32 (kept by ReLU), the ReLU
    # output 8×32, the logits' softmax 8×3 (cross-entropy), float32
    assert 4 * (8 * 64 + 8 * 32) <= act <= 4 * (8 * 64 + 3 * 8 * 32 + 8 * 3 + 64)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert guard.client_footprint(model, (x, y), cross_entropy, 100) == act + guard.PARAM_COPIES * params + 100
    loop = contract_loop("fedavg", client_parallelism="vmap", vmap_chunk="auto")
    monkeypatch.setattr(guard, "free_bytes", lambda device: 0)  # nothing free: one client per chunk
    import fedlight.runners.stacked as stacked

    monkeypatch.setattr(stacked, "free_bytes", lambda device: 0)
    loop.run_round(0)
    assert loop.runner.chunk == 1
    assert LoopConfig(vmap_chunk="auto").vmap_chunk == "auto"
    with pytest.raises(ConfigError, match="auto or null"):
        LoopConfig(vmap_chunk="most")


def test_loop_compile_values_are_checked():
    with pytest.raises(ConfigError, match=r"`loop.compile` must be .*reduce-overhead.*inductor.*got 'bogus'"):
        LoopConfig(compile="bogus")
    for ok in (None, True, False, "reduce-overhead", "aot_eager", "inductor"):
        LoopConfig(compile=ok)


def test_reduce_overhead_on_cpu_says_it_compiles_as_true(capsys):
    loop = contract_loop("fedavg", client_parallelism="vmap", compile="reduce-overhead")
    assert loop.runner.forward is StackedForward.shared(loop.model, loop.fabric, True)
    assert "on cpu it compiles as `loop.compile: true` does" in capsys.readouterr().err
    assert P.nbytes(loop.x) > 0


def test_fit_without_a_cxx_compiler_falls_back_and_records_it(tmp_path, monkeypatch, capsys):
    """The user's first run on a machine where inductor cannot build: the run completes, eager stacked, with the
    same numbers, and summary.json names the runner that trained and the fallback. (The compiled run is a process of
    its own, whose inductor has never found a compiler; the eager one, which compiles nothing, runs in this one.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fedlight.config.cli import main

    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    env = dict(os.environ, CXX="/bin/false", CC="/bin/false", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))

    def args(name, compile):
        return ["fit", "--config", tiny, "--loop.client_parallelism", "vmap", "--loop.compile", compile,
                "--out_dir", str(tmp_path / name)]

    res = subprocess.run([sys.executable, "-m", "fedlight", *args("compiled", "true")], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    summary, err = json.loads((tmp_path / "compiled" / "summary.json").read_text()), res.stderr
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # what the CLI sets for a CPU run (here: not left behind)
    assert main(args("eager", "false")) == 0, capsys.readouterr().err[-3000:]
    eager = json.loads((tmp_path / "eager" / "summary.json").read_text())
    assert summary["client_runner"].startswith("stacked, eager")
    fallbacks = summary["client_runner_fallbacks"]
    assert len(fallbacks) == 1 and "InvalidCxxCompiler" in fallbacks[0]
    assert err.count("torch.compile of the stacked step failed") == 1 and "Traceback" not in err
    assert summary["final_train_loss"] == eager["final_train_loss"]
    assert summary["final_test_acc"] == eager["final_test_acc"]
    assert eager["client_runner_fallbacks"] == []


def test_cli_refuses_a_bogus_compile_value_with_exit_2(tmp_path, capsys):
    from pathlib import Path

    from fedlight.config import cli
    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert cli.main(["fit", "--config", tiny, "--loop.compile", "bogus", "--out_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "`loop.compile` must be" in err and "inductor" in err and "InvalidBackend" not in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value", ["bogus", "0", "-2"])
def test_cli_refuses_a_bad_vmap_chunk_with_the_valid_values(tmp_path, capsys, value):
    """Was jsonargparse's `Parser key "loop.vmap_chunk": Given value: bogus`, naming no valid value."""
    from pathlib import Path

    from fedlight.config import cli
    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert cli.main(["fit", "--config", tiny, "--loop.vmap_chunk", value, "--out_dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "`loop.vmap_chunk` must be a positive integer, auto or null" in err and "Given value" not in err
    assert not (tmp_path / "r").exists()


def test_vmap_chunk_accepts_a_number_auto_and_null():
    assert [LoopConfig(vmap_chunk=v).vmap_chunk for v in (3, "auto", None)] == [3, "auto", None]


def test_vmap_chunk_auto_sizes_token_batches_with_the_task(tmp_path, monkeypatch, capsys):
    """``vmap_chunk: auto`` on a language-modeling run (int64 tokens and per-token targets, logits ``[B, T, V]``,
    which a cross-entropy default over ``[B, C]`` logits refused): the footprint is measured with the run's task,
    the chunks it picks train the same numbers as one client after another."""
    from fedtest import spy_auto_chunk

    from fedlight.data import MarkovText
    from fedlight.models import TinyGPT
    from fedlight.tasks import LanguageModeling

    seen = spy_auto_chunk(monkeypatch, chunk=2)
    out = {}
    for mode, chunk in (("sequential", None), ("vmap", "auto")):
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=16, dim=16, layers=1, heads=2, max_len=12)
        data = MarkovText(num_clients=4, vocab_size=16, seq_len=12, sequences_per_client=8, batch_size=4)
        fedlight.fit(model, data, loop=LoopConfig(rounds=1, clients_per_round=3, local_steps=2, lr=0.1,
                                                  client_parallelism=mode, vmap_chunk=chunk, progress=False),
                     out_dir=str(tmp_path / mode))
        out[mode] = P.clone(P.trainable(model))
    (batch, objective, _), = seen
    assert [(t.dtype, tuple(t.shape)) for t in batch] == [(torch.int64, (4, 12))] * 2
    assert isinstance(objective.args[1].__self__, LanguageModeling)
    assert "loop.vmap_chunk auto: 2 clients per chunk" in capsys.readouterr().err
    for k, v in out["sequential"].items():
        torch.testing.assert_close(out["vmap"][k], v, rtol=1e-4, atol=1e-6)

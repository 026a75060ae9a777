"""LoopState is the one author of a checkpoint: snapshot() and restore() are exact inverses over every key, and a
checkpoint with a key they do not know (or without one) is refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from fedtest import linear_model, make_loop, problem, resume

import fedlight
from fedlight.engine.loop_state import CHECKPOINT_KEYS
from fedlight.errors import ConfigError
from fedlight.run.atomic import atomic_torch_save


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def loops(tmp_path):
    clients, theta = problem(num_clients=3)
    return [make_loop(fedlight.create("scaffold"), clients, linear_model(theta), rounds=3, out_dir=tmp_path / n)
            for n in ("a", "b")]


def test_snapshot_restore_round_trip_carries_every_key(tmp_path):
    a, b = loops(tmp_path)
    a.state.settings = {"loop": {"lr": 0.1}, "seed": 0}
    a.state.begin_segment({"devices": 1})
    rows = [a.run_round(r) for r in range(2)]
    snap = a.state.snapshot()
    assert tuple(snap) == CHECKPOINT_KEYS
    b.state.restore(snap, "cpu")
    again = b.state.snapshot()
    assert same(again, snap)  # exact inverses: settings, segments, last row, totals, store, server, model
    assert b.state.last_row == rows[-1] and b.state.segments == [{"from_round": 0, "settings": {"devices": 1}}]
    assert b.state.totals["bytes_up"] == sum(r["bytes_up"] for r in rows) > 0  # the loop counts its own totals
    b.state.begin_segment({"devices": 2})
    assert b.state.segments[-1] == {"from_round": 2, "settings": {"devices": 2}, "changed": ["devices"]}
    a.run_round(2), b.run_round(2)
    assert same(b.state.params, a.state.params)  # and the run goes on bit for bit


@pytest.mark.parametrize("change,why", [(lambda c: {**c, "tracker_run": "x"}, "does not know: tracker_run"),
                                        (lambda c: {k: v for k, v in c.items() if k != "segments"},
                                         "lacks keys: segments")], ids=["unknown", "missing"])
def test_a_checkpoint_with_other_keys_is_refused_by_name(tmp_path, change, why):
    a, b = loops(tmp_path)
    a.run_round(0)
    ckpt = change(a.state.snapshot())
    with pytest.raises(ConfigError, match=why):
        b.state.restore(ckpt, "cpu")
    assert b.state.rounds_done == 0
    path = tmp_path / "last.ckpt"
    atomic_torch_save(ckpt, path)  # sealed, as a run writes it
    with pytest.raises(ConfigError, match=rf"`resume` checkpoint {re.escape(str(path))} .*{why}"):
        resume(b, path)

"""A LightningModule under the streams runner (issue 31): each client is the sequential runner's, on its own copy of
the module, so the final model and the module's own logged metrics are those of sequential training, bit for bit."""

import json

import torch
from lit import LitMLP
from test_lightning import _fit

import fedlight


def test_streams_equal_sequential_for_a_lightning_module_and_its_logs(tmp_path):
    finals, rows = {}, {}
    for mode in ("sequential", "streams"):
        torch.manual_seed(0)
        _fit(tmp_path, LitMLP(), name=mode, algorithm=fedlight.create("scaffold"), loop={"client_parallelism": mode})
        finals[mode] = torch.load(tmp_path / mode / "final_model.pt", weights_only=True)
        rows[mode] = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    for k, v in finals["sequential"].items():
        assert torch.equal(finals["streams"][k], v), k
    for a, b in zip(rows["sequential"], rows["streams"], strict=True):
        assert (a["train_loss"], a["train/train_acc"]) == (b["train_loss"], b["train/train_acc"])
    assert "streams" in json.loads((tmp_path / "streams" / "summary.json").read_text())["client_runner"]

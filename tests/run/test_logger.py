"""TensorBoard record of a run: read the event files back and compare them with metrics.jsonl and summary.json."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

GROUPS = {"test", "train", "server", "rule", "time", "comm", "summary"}


def _accumulator(tb: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    ea.Reload()
    return ea


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import fedlight
    from fedlight.algorithms import SCAFFOLD
    from fedlight.core.loop_config import LoopConfig
    from fedlight.data import Synthetic
    from fedlight.models import MLP

    out = tmp_path_factory.mktemp("logger") / "run"
    summary = fedlight.fit(MLP(in_features=60, hidden=[16], num_classes=10),
                           Synthetic(num_clients=6, samples_per_client=40), SCAFFOLD(),
                           LoopConfig(rounds=2, clients_per_round=3, local_steps=2, progress=False, targets=[0.05]),
                           out_dir=str(out), accelerator="cpu")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"dir": out, "summary": summary, "rows": rows, "ea": _accumulator(out / "tb")}


def test_every_row_value_is_a_grouped_scalar(run):
    from fedlight.run.tensorboard import tag

    ea, rows = run["ea"], run["rows"]
    scalars = set(ea.Tags()["scalars"])
    assert {t.split("/")[0] for t in scalars} <= GROUPS
    expected = {"train/loss", "train/lr", "test/acc", "test/loss", "train/flatness_distance", "server/update_norm",
                "rule/control_gap_norm", "server/c_norm", "comm/bytes_up", "comm/bytes_down", "time/round_s",
                "time/train_s", "time/aggregate_s", "time/eval_s", "time/checkpoint_s", "time/total_s"}
    assert expected <= scalars
    assert len(rows) == 2
    for row in rows:
        for key, value in row.items():
            if key == "round" or isinstance(value, (list, bool, str)):  # ids, clients, warm_up, chain: not scalars
                continue
            events = {e.step: e.value for e in ea.Scalars(tag(key))}
            assert events[row["round"]] == pytest.approx(value, rel=1e-6, abs=1e-30), key
        total = {e.step: e.value for e in ea.Scalars("time/total_s")}[row["round"]]
        parts = sum(row[k] for k in ("train_time_s", "aggregate_time_s", "eval_time_s", "checkpoint_time_s"))
        assert total == pytest.approx(parts, rel=1e-6)
    for t in expected:  # one value per round, no duplicates
        assert [e.step for e in ea.Scalars(t)] == [1, 2], t


def test_hparams_and_final_metrics(run):
    from tensorboard.plugins.hparams import metadata

    ea, summary = run["ea"], run["summary"]
    content = ea.PluginTagToContent("hparams")
    assert metadata.SESSION_START_INFO_TAG in content and metadata.SESSION_END_INFO_TAG in content
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    hp = start.hparams
    assert hp["algorithm"].string_value == "scaffold"
    assert hp["loop.rounds"].number_value == 2 and hp["loop.lr"].number_value == pytest.approx(0.1)
    assert hp["seed"].number_value == 0
    assert hp["model"].string_value == "MLP" and hp["data"].string_value == "Synthetic"  # from config.yaml
    for key in ("final_test_acc", "best_test_acc", "final_train_loss", "seconds_per_round", "bytes_up"):
        (event,) = ea.Scalars(f"summary/{key}")
        assert event.step == 2 and event.value == pytest.approx(summary[key], rel=1e-6), key
    (r,) = ea.Scalars("summary/rounds_to_0.05")
    assert r.value == summary["rounds_to_target"]["0.05"]


def test_config_partition_and_layout(run):
    from PIL import Image

    ea = run["ea"]
    tensors = set(ea.Tags()["tensors"])
    assert {"config/text_summary", "data/partition/text_summary", "custom_scalars__config__"} <= tensors
    config = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "class_path" in config and "SCAFFOLD" in config
    partition = ea.Tensors("data/partition/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "6 clients" in partition
    (image,) = ea.Images("data/class_histogram")
    pic = Image.open(io.BytesIO(image.encoded_image_string))
    assert pic.size == (image.width, image.height) and image.width > 200 and image.height > 100
    assert np.asarray(pic).std() > 0  # not a blank canvas


def test_histogram_image_both_styles():
    from fedlight.run.tensorboard import class_histogram_image

    rng = np.random.default_rng(0)
    bars = class_histogram_image(rng.integers(0, 30, (12, 4)))
    heat = class_histogram_image(rng.integers(0, 30, (300, 50)))
    for img in (bars, heat):
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3


def test_resumed_rounds_replace_the_interrupted_ones(tmp_path):
    """A resumed run re-logs the rounds after its checkpoint; TensorBoard keeps only the new values."""
    from fedlight.run.tensorboard import RunLogger

    first = RunLogger(tmp_path)
    for r in (1, 2, 3):
        first.log_round({"round": r, "train_loss": float(r)}, step=r)
    first.close()
    # TensorBoard reads a folder's event files in name order: time (s), host, pid, then a per-process writer count.
    # A resumed run is a later process; here both writers share this process and maybe one second, and the count
    # sorts as text (writer 10 before writer 9 in a long suite), so date the first attempt's file a second earlier.
    (old,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    stamp = old.name.split(".")[3]
    old.rename(old.with_name(old.name.replace(f".{stamp}.", f".{int(stamp) - 1:010d}.", 1)))
    second = RunLogger(tmp_path)  # resumed from the checkpoint after round 1
    for r in (2, 3, 4):
        second.log_round({"round": r, "train_loss": 10.0 * r}, step=r)
    second.close()
    events = _accumulator(tmp_path / "tb").Scalars("train/loss")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


@pytest.mark.parametrize("values", [[1e31, 2e31, 3e31], [1e31] * 3, [0.0, 1.7e308], [-1.7e308, 1.7e308],
                                    [1.7976931348623157e308] * 2, [5e-324, 1.0]])
def test_histograms_of_any_finite_values(values, tmp_path):
    """TensorBoard's own bins end at ±1e20: client update norms near 1e31 left every bin empty (``ValueError: The
    histogram is empty``). Every finite value is counted, at its own value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fedlight.run.tensorboard import RunLogger

    logger = RunLogger(tmp_path)
    logger.log_round({"round": 1, "clients": [{"delta_norm": v} for v in values]}, 1)
    logger.close()
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"histograms": 0})
    ea.Reload()
    (h,) = ea.Histograms("clients/delta_norm")
    assert (h.histogram_value.num, h.histogram_value.min, h.histogram_value.max) == (len(values), min(values),
                                                                                    max(values))


def test_a_run_whose_updates_are_huge_logs_them_and_says_its_evaluation_is_not_finite(tmp_path, capsys):
    """lr 1e30 in float64: every client's update norm is near 1e31 (finite) and the test loss NaN from round 1. The run
    finishes (it ended with a TensorBoard traceback after round 1), its histograms hold the norms, and the non-finite
    evaluation is said in one line the round it happens."""
    from fedlight.config.cli import main

    out = tmp_path / "run"
    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert main(["fit", "--config", tiny, "--out_dir", str(out), "--loop.lr", "1e30", "--precision", "64-true",
                 "--algorithm", "FedAvg", "--loop.rounds", "3", "--loop.local_steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "histogram" not in err, err
    said = [ln for ln in err.splitlines() if "evaluation is not finite" in ln]
    assert said == [f"fedlight: warning: round 1: the evaluation is not finite (test_loss: NaN or infinite, null in "
                    f"metrics.jsonl). Likely cause: {said[0].split('Likely cause: ')[1]}"], err  # once, the round
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    norms = [c["delta_norm"] for c in rows[0]["clients"]]
    assert 1e29 < min(norms) and max(norms) < 1e32 and "test_loss" in rows[0]["nonfinite"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(out / "tb"), size_guidance={"histograms": 0})
    ea.Reload()
    first = ea.Histograms("clients/delta_norm")[0]
    assert (first.step, first.histogram_value.min, first.histogram_value.max) == (1, min(norms), max(norms))


def test_a_failing_tensorboard_is_one_line_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """Any TensorBoard failure that is not a failed write (that one is exit 74, resumable) is one warning line naming
    TensorBoard and the cause; the run finishes with every row."""
    from fedlight.config.cli import main
    from fedlight.run import tensorboard

    def broken(self, row, step):
        if step == 2:
            raise ValueError("the histogram is empty, please file a bug report")

    monkeypatch.setattr(tensorboard.RunLogger, "log_round", broken)
    out = tmp_path / "run"
    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    assert main(["fit", "--config", tiny, "--out_dir", str(out), "--loop.rounds", "3"]) == 0
    err = capsys.readouterr().err
    assert (f"fedlight: warning: TensorBoard failed at round 2 (ValueError: the histogram is empty, please file a bug "
            f"report); training goes on without it, and {out / 'tb'} holds the rounds before") in err, err
    assert "Traceback" not in err and err.count("TensorBoard failed") == 1
    assert [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert main(["verify", str(out)]) == 0


def test_in_a_lockstep_group_the_member_with_huge_updates_finishes_too(tmp_path, capsys):
    """The same run as a member of a group (it failed there, the others going on): every member finishes."""
    from fedlight.config.cli import main

    tiny = str(Path(__file__).parent.parent / "configs" / "tiny.yaml")
    flags = ["--config", tiny, "--precision", "64-true", "--algorithm", "FedAvg", "--loop.rounds", "2",
             "--loop.local_steps", "1"]
    assert main(["lockstep", *flags, "--loop.lr", "1e30", "--out_dir", str(tmp_path / "huge"), "::", *flags,
                 "--out_dir", str(tmp_path / "plain")]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "left the group" not in err, err
    assert "round 1: the evaluation is not finite" in err
    for name in ("huge", "plain"):
        assert json.loads((tmp_path / name / "summary.json").read_text())["rounds_completed"] == 2

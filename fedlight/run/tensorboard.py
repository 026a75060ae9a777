"""TensorBoard logging of a run: per-round scalars grouped by prefix, config text, hparams, partition.

The loop hands every per-round row (the same dict written to ``metrics.jsonl``) to :meth:`RunLogger.log_round`.
What lands in ``<run>/tb``:

* per-client histograms ``clients/train_loss``, ``clients/delta_norm``, ``clients/num_samples`` of each round;
* scalars, one tag per ``metrics.jsonl`` key, grouped ``test/``, ``train/``, ``server/``, ``rule/``, ``time/``,
  ``comm/`` (see :data:`TAGS`); ``time/total_s`` adds training, aggregation, evaluation and checkpointing;
* a "Custom Scalars" layout with the per-round time breakdown, accuracy/loss and communication in one chart each;
* the resolved config (text ``config``) and the partition (text ``data/partition``, image ``data/class_histogram``);
* the hyperparameters and final metrics (``summary/*`` scalars) through the hparams plugin, so
  ``tensorboard --logdir runs`` compares every run in one table.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from fedlight.run import faults

# metrics.jsonl key -> TensorBoard tag (keys with a "group/" prefix are used as they are)
TAGS = {"lr": "train/lr", "train_loss": "train/loss", "test_acc": "test/acc", "test_loss": "test/loss",
        "round_time_s": "time/round_s", "train_time_s": "time/train_s", "aggregate_time_s": "time/aggregate_s",
        "eval_time_s": "time/eval_s", "checkpoint_time_s": "time/checkpoint_s", "bytes_up": "comm/bytes_up",
        "bytes_down": "comm/bytes_down", "flatness_distance": "train/flatness_distance",
        "update_norm": "server/update_norm"}

CLIENT_KEYS = ("train_loss", "delta_norm", "num_samples")
"""Entries of each ``metrics.jsonl`` ``clients`` item logged as ``clients/<key>`` histograms."""

TIME_PARTS = ("train_time_s", "aggregate_time_s", "eval_time_s", "checkpoint_time_s")
"""The per-round time breakdown; ``time/total_s`` is their sum (``round_time_s`` = train + aggregate)."""

SUMMARY_KEYS = ("final_test_acc", "best_test_acc", "final_test_loss", "final_train_loss", "best_round",
                "rounds_completed", "seconds_per_round", "seconds_per_round_with_eval", "wall_time_s", "bytes_up",
                "bytes_down")
"""summary.json entries logged as ``summary/<key>`` scalars: the metric columns of the hparams table."""


def tag(key: str) -> str:
    if key in TAGS:
        return TAGS[key]
    if key.startswith("test_"):  # every task metric: test_mse -> test/mse
        return f"test/{key[len('test_'):]}"
    return key if "/" in key else f"train/{key}"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _hparam_value(v: Any) -> int | float | str | bool:
    """The hparams plugin takes bool, number or string; everything else is shown as its string."""
    if isinstance(v, (bool, int, float, str)):
        return v
    return "null" if v is None else str(v)


def config_hparams(text: str) -> dict[str, Any]:
    """``model``/``data`` class names and their scalar ``init_args`` from a resolved recipe (for the hparams table)."""
    import yaml

    try:
        cfg = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return {}
    out: dict[str, Any] = {}
    for part in ("model", "data"):
        spec = cfg.get(part) if isinstance(cfg, dict) else None
        if not isinstance(spec, dict) or "class_path" not in spec:
            continue
        out[part] = str(spec["class_path"]).rsplit(".", 1)[-1]
        for k, v in (spec.get("init_args") or {}).items():
            if isinstance(v, (bool, int, float, str)):
                out[f"{part}.{k}"] = v
            elif isinstance(v, dict) and "class_path" in v:  # e.g. data.partition
                out[f"{part}.{k}"] = str(v["class_path"]).rsplit(".", 1)[-1]
                for kk, vv in (v.get("init_args") or {}).items():
                    if isinstance(vv, (bool, int, float, str)):
                        out[f"{part}.{k}.{kk}"] = vv
    return out


def class_histogram_image(hist: np.ndarray, title: str = "") -> np.ndarray:
    """An ``[H, W, 3]`` uint8 picture of a ``[num_clients, num_classes]`` count matrix.

    Stacked bars (one per client, one colour per class) up to 100 clients and 20 classes, else a heatmap.
    Drawn on a bare Agg canvas (no pyplot state), so it is safe in any process and costs tens of milliseconds.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    hist = np.asarray(hist)
    n, c = hist.shape
    fig = Figure(figsize=(min(12.0, 4.0 + 0.08 * n), 3.6), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if n <= 100 and c <= 20:
        # one filled polygon per class (bars drawn as a step outline): far cheaper than n·c bar patches
        x = (np.arange(n)[:, None] + np.array([-0.45, -0.45, 0.45, 0.45])).ravel()
        edge = np.array([0.0, 1.0, 1.0, 0.0])
        layers = (hist[:, :, None] * edge).transpose(1, 0, 2).reshape(c, -1)
        ax.stackplot(x, layers, colors=_colors(c), labels=[str(k) for k in range(c)], linewidth=0)
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylabel("samples")
        ax.legend(title="class", fontsize=6, title_fontsize=7, ncol=1 + c // 10, loc="upper left",
                  bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        im = ax.imshow(hist.T, aspect="auto", interpolation="nearest", cmap="viridis", origin="lower")
        ax.set_ylabel("class")
        fig.colorbar(im, ax=ax, label="samples")
    ax.set_xlabel("client")
    ax.set_title(title or f"{n} clients × {c} classes", fontsize=9)
    fig.tight_layout()
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


def _colors(k: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if k <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(k)]


def histogram_bins(values: np.ndarray) -> str | np.ndarray:
    """TensorBoard's own bins (``"tensorflow"``: ±1e-12 … ±1e20, exponentially spaced) when they hold every value,
    else 64 equal bins over the values' range, computed so that no edge overflows (any finite values: client update
    norms near 1e31 left TensorBoard's bins empty, ``ValueError: The histogram is empty``)."""
    lo, hi = float(values.min()), float(values.max())
    if max(abs(lo), abs(hi)) < 1e20:
        return "tensorflow"
    t = np.linspace(0.0, 1.0, 65)
    edges = np.unique(lo * (1 - t) + hi * t)  # each term finite, their sum between lo and hi
    if edges.size < 2:  # every value equal: one bin of the next float's width
        edges = np.array([np.nextafter(lo, -np.inf), lo]) if lo > 0 else np.array([lo, np.nextafter(lo, np.inf)])
    return edges


class RunLogger:
    """Writes TensorBoard event files under ``out_dir/tb``.

    Args:
        out_dir: the run directory.
    """

    def __init__(self, out_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir = Path(out_dir)
        self.dir = self.out_dir / "tb"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        if os.environ.get("FEDLIGHT_FAULT", "").startswith("write:tfevents:"):  # the disk-failure tests
            records = self.writer.file_writer.event_writer._async_writer._writer  # TensorBoard's RecordWriter
            records._writer = faults.FaultyFile(records._writer, self.dir / "tfevents")
        self._config_text = ""
        self._first_step: int | None = None
        self._layout_written = False

    # ------------------------------------------------------------------------------------------ once per run
    def log_config(self, text: str) -> None:
        """The resolved recipe as text (falls back to ``out_dir/config.yaml`` when ``text`` is empty)."""
        if not text and (self.out_dir / "config.yaml").is_file():
            text = (self.out_dir / "config.yaml").read_text()
        self._config_text = text or ""
        self.writer.add_text("config", "```yaml\n" + self._config_text + "\n```", 0)
        self._write_layout()

    def log_partition(self, data: Any) -> None:
        """The partition's per-client class histogram, as a text table and as an image."""
        report = getattr(data, "partition_report", None)
        if report is not None:
            self.writer.add_text("data/partition", "```\n" + report() + "\n```", 0)
        histogram = getattr(data, "class_histogram", None)
        if histogram is not None:
            hist = np.asarray(histogram())
            if hist.ndim == 2 and hist.size:
                title = f"{type(data).__name__}: {hist.shape[0]} clients × {hist.shape[1]} classes"
                self.writer.add_image("data/class_histogram", class_histogram_image(hist, title), 0,
                                      dataformats="HWC")
        self.writer.flush()

    def _write_layout(self) -> None:
        """Custom Scalars dashboard: the charts that tell a run's story, side by side."""
        if self._layout_written:
            return
        self._layout_written = True
        self.writer.add_custom_scalars({
            "round": {
                "time breakdown (s)": ["Multiline", [tag(k) for k in TIME_PARTS] + ["time/total_s"]],
                "accuracy": ["Multiline", ["test/acc"]],
                "loss": ["Multiline", ["train/loss", "test/loss"]],
                "communication (bytes)": ["Multiline", ["comm/bytes_down", "comm/bytes_up"]],
                "flatness and update": ["Multiline", ["train/flatness_distance", "server/update_norm"]],
            },
            "rule": {"diagnostics": ["Multiline", ["rule/.*", "server/.*"]]},
        })

    # ------------------------------------------------------------------------------------------ per round
    def log_round(self, row: dict[str, Any], step: int) -> None:
        """Every numeric entry of a ``metrics.jsonl`` row, under its grouped tag, at ``step`` (the round)."""
        if self._first_step is None:
            self._first_step = step
            self._purge_from(step)
        for k, v in row.items():
            x = _number(v)
            if k != "round" and x is not None:
                self.writer.add_scalar(tag(k), x, step)
        self._client_histograms(row.get("clients"), step)
        parts = [_number(row.get(k)) for k in TIME_PARTS]
        if any(p is not None for p in parts):
            self.writer.add_scalar("time/total_s", sum(p for p in parts if p is not None), step)
        self.writer.flush()

    def _client_histograms(self, clients: Any, step: int) -> None:
        """Per-client train loss, update norm ‖Δ_i‖ and sample count of the round as ``clients/*`` histograms."""
        if not isinstance(clients, list) or not clients:
            return
        for key in CLIENT_KEYS:
            values = [_number(c.get(key)) for c in clients if isinstance(c, dict)]
            values = [v for v in values if v is not None and math.isfinite(v)]
            if values:
                values = np.asarray(values, dtype=np.float64)
                with np.errstate(over="ignore"):  # the sum of squares of values near 1e200 is inf: kept as such
                    self.writer.add_histogram(f"clients/{key}", values, step, bins=histogram_bins(values))

    def _purge_from(self, step: int) -> None:
        """A resumed run re-logs rounds after its checkpoint: a session-start event at ``step`` makes TensorBoard
        drop what an interrupted attempt wrote at steps ≥ ``step`` (``SummaryWriter(purge_step=...)``'s mechanism)."""
        if step <= 1:
            return
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self.writer.file_writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))

    # ------------------------------------------------------------------------------------------ end of run
    def log_summary(self, hparams: dict[str, Any], summary: dict[str, Any]) -> None:
        """Hyperparameters and final metrics through the hparams plugin, so runs compare in one table.

        Final metrics are ``summary/<key>`` scalars at the last round; the hparams are the given dict plus the
        model and data classes (and their scalar arguments) read from the resolved config. Only the session
        records are written, not an experiment record: TensorBoard then builds the table's columns from every
        run under ``--logdir`` (algorithms differ in their hyperparameters), instead of from one arbitrary run's.
        """
        from torch.utils.tensorboard.summary import hparams as hparams_summary

        step = int(summary.get("rounds_completed") or 0)
        metrics: dict[str, float] = {}
        keys = [*SUMMARY_KEYS, *(k for k in summary if k.startswith(("final_test_", "best_test_")))]
        for k in dict.fromkeys(keys):
            x = _number(summary.get(k))
            if x is not None and math.isfinite(x):
                metrics[f"summary/{k}"] = x
        for t, r in (summary.get("rounds_to_target") or {}).items():
            if r is not None:
                metrics[f"summary/rounds_to_{t}"] = float(r)
        for k, x in metrics.items():
            self.writer.add_scalar(k, x, step)
        hp = {**config_hparams(self._config_text), **hparams}
        hp = {k: _hparam_value(v) for k, v in hp.items()}
        _, ssi, sei = hparams_summary(hp, metrics)
        self.writer.file_writer.add_summary(ssi, step)
        self.writer.file_writer.add_summary(sei, step)
        self.writer.flush()

    def log_figure(self, name: str, figure: Any, step: int = 0) -> None:
        """A matplotlib figure as an image (used by ``fedlight landscape``)."""
        figure.canvas.draw()
        img = np.asarray(figure.canvas.buffer_rgba())[..., :3].copy()
        self.writer.add_image(name, img, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

"""TensorBoard logging of a run: per-round scalars grouped by prefix, config text, hparams, partition.

The loop hands every per-round row (the same dict written to ``metrics.jsonl``) to :meth:`RunLogger.log_round`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# metrics.jsonl key -> TensorBoard tag (keys with a "group/" prefix are used as they are)
TAGS = {"lr": "train/lr", "train_loss": "train/loss", "test_acc": "test/acc", "test_loss": "test/loss",
        "round_time_s": "time/round_s", "train_time_s": "time/train_s", "aggregate_time_s": "time/aggregate_s",
        "eval_time_s": "time/eval_s", "checkpoint_time_s": "time/checkpoint_s", "bytes_up": "comm/bytes_up",
        "bytes_down": "comm/bytes_down", "flatness_distance": "train/flatness_distance",
        "update_norm": "server/update_norm"}


def tag(key: str) -> str:
    return TAGS.get(key, key if "/" in key else f"train/{key}")


class RunLogger:
    """Writes TensorBoard event files under ``out_dir/tb``."""

    def __init__(self, out_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = Path(out_dir) / "tb"
        self.writer = SummaryWriter(log_dir=str(self.dir))

    def log_config(self, text: str) -> None:
        self.writer.add_text("config", "```yaml\n" + text + "\n```", 0)

    def log_partition(self, data: Any) -> None:
        """The partition's class histogram, as text (and, when the data module provides one, an image)."""
        report = getattr(data, "partition_report", None)
        if report is not None:
            self.writer.add_text("data/partition", "```\n" + report() + "\n```", 0)

    def log_round(self, row: dict[str, Any], step: int) -> None:
        for k, v in row.items():
            if k != "round" and isinstance(v, (int, float)) and v is not None:
                self.writer.add_scalar(tag(k), float(v), step)
        self.writer.flush()

    def log_summary(self, hparams: dict[str, Any], summary: dict[str, Any]) -> None:
        """Hyperparameters and final metrics through the hparams plugin, so runs compare in one table."""

    def close(self) -> None:
        self.writer.close()

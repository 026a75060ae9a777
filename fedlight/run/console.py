"""What a run prints while it trains: a bar in a terminal, plain lines elsewhere, and warnings.

In a terminal (stderr is a TTY) a tqdm bar shows the phase (``training`` / ``evaluating``) of the round under way.
Otherwise (nohup, batch jobs, log files) one line per round is printed, or every ``every`` rounds on long runs, and
whenever :data:`LINE_SECONDS` passed since the last line: round, test accuracy, train loss, s/round (training, and
with evaluation: :func:`~fedlight.run.files.seconds_per_round`, as in ``summary.json``) and ETA.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from fedlight.run.files import format_metric, seconds_per_round

LINE_SECONDS = 30.0
"""Without a terminal, a line at least this often (in seconds) whatever the cadence."""

TIMES = ("round", "round_time_s", "eval_time_s", "checkpoint_time_s", "warm_up")
"""What the console keeps of each row: enough for :func:`~fedlight.run.files.seconds_per_round`."""

LOSS_ALARM = 5.0
"""Warn when a round's train loss exceeds this many times the first round's (or is not finite)."""


def _fmt_time(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _times(row: dict[str, Any]) -> dict[str, Any]:
    return {k: row[k] for k in TIMES if k in row}


class Progress:
    """Progress display of one run on rank 0 (``enabled=False``: prints nothing)."""

    def __init__(self, rounds: int, enabled: bool = True, stream=None) -> None:
        self.rounds, self.enabled = rounds, enabled
        self.stream = stream
        self.bar = None
        self.start_round = 0
        self.every = max(1, math.ceil(rounds / 100))
        self.rows: list[dict[str, Any]] = []
        self.last_line = 0.0
        self.acc: float | None = None
        self.key = "test_acc"
        """The headline metric shown (the task's ``test_<headline>``)."""

    @property
    def out(self):
        return self.stream or sys.stderr

    def start(self, start_round: int, rows: list[dict[str, Any]]) -> None:
        self.start_round = start_round
        self.rows = [_times(r) for r in rows]  # a resumed run's s/round covers the whole run, as summary.json's
        self.acc = next((r[self.key] for r in reversed(rows) if r.get(self.key) is not None), None)
        self.last_line = time.monotonic()
        if self.enabled and self.out.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.rounds, initial=start_round, desc="training", unit="round", file=self.out)

    def phase(self, name: str, round: int) -> None:
        if self.bar is not None:
            self.bar.set_description(f"round {round + 1} {name}", refresh=True)

    def update(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        r = int(row["round"])
        self.rows.append(_times(row))
        if row.get(self.key) is not None:
            self.acc = row[self.key]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({self.key: format_metric(self.key, self.acc),
                                  "s_per_round": round(seconds_per_round(self.rows[-1:])[1] or 0, 3)})
            return
        now = time.monotonic()
        due = r == self.start_round + 1 or r == self.rounds or r % self.every == 0 or now - self.last_line >= \
            LINE_SECONDS
        if due:
            self.last_line = now
            print(self.line(row), file=self.out, flush=True)

    def line(self, row: dict[str, Any]) -> str:
        r = int(row["round"])
        train, spr = seconds_per_round(self.rows)
        train, spr = train or 0.0, spr or 0.0
        acc = format_metric(self.key, self.acc)
        loss = row.get("train_loss")
        loss = "-" if loss is None else f"{loss:.4g}"
        return (f"round {r}/{self.rounds}  {self.key} {acc}  train_loss {loss}  s/round {train:.3f} training, "
                f"{spr:.3f} with eval  ETA {_fmt_time(spr * (self.rounds - r))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class RoundWatch:
    """Warns once when the train loss explodes relative to the first round's, naming the likely cause, and the round
    an evaluation is not finite."""

    def __init__(self, hint: str = "", stream=None) -> None:
        self.hint, self.stream = hint, stream
        self.first_loss: float | None = None
        self.warned = False
        self.nonfinite_eval = False  # the last evaluation was not finite (said once, until one is finite again)

    def check(self, row: dict[str, Any]) -> str | None:
        self._evaluation(row)
        loss = row.get("train_loss")
        if "train_loss" in (row.get("nonfinite") or []):
            loss = math.inf
        if loss is None or self.warned:
            return None
        if self.first_loss is None:
            self.first_loss = loss
            return None
        if not (loss > LOSS_ALARM * max(self.first_loss, 1e-12)):
            return None
        self.warned = True
        cause = self.hint or "the learning rate `loop.lr` is too large for this rule"
        msg = (f"fedlight: warning: round {row['round']} train loss {loss:.4g} is more than {LOSS_ALARM:g}× the "
               f"first round's ({self.first_loss:.4g}); training is diverging. Likely cause: {cause}")
        print(msg, file=self.stream or sys.stderr, flush=True)
        return msg

    def _evaluation(self, row: dict[str, Any]) -> None:
        """One line the round an evaluation is not finite (a NaN or infinite test metric, ``null`` in the row); said
        again only after a finite one."""
        tested = [k for k in row if k.startswith("test_")]
        if not tested:
            return
        bad = [k for k in (row.get("nonfinite") or []) if k.startswith("test_")]
        if bad and not self.nonfinite_eval:
            print(f"fedlight: warning: round {row['round']}: the evaluation is not finite ({', '.join(bad)}: NaN or "
                  "infinite, null in metrics.jsonl). Likely cause: "
                  f"{self.hint or 'the learning rate `loop.lr` is too large for this rule'}",
                  file=self.stream or sys.stderr, flush=True)
        self.nonfinite_eval = bool(bad)

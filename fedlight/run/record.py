"""RunRecord: the one object that writes a run directory, so the round code never touches files.

It owns ``config.yaml``, ``metrics.jsonl``, TensorBoard (``tb/``), ``checkpoints/last.ckpt``, ``final_model.pt``,
``summary.json``, the run lock and what a run prints (progress lines or bar, warnings). Only global rank 0 writes;
on other ranks every method is a no-op.

Checkpoints leave the critical path. The loop hands :meth:`RunRecord.round_done` a snapshot (CPU copies made on the
main thread) and goes on with the next round while one background thread writes it: temporary file, fsync, rename
(atomic). One thread, first in first out, and at most one checkpoint in flight (a new one waits for the previous).
**Ordering**: a round's ``metrics.jsonl`` line is appended by that same thread, after the checkpoint of its round
(if any) is renamed, and after every earlier line. So the file never runs ahead of what a resume can rebuild: a
kill loses no round whose checkpoint was renamed (the checkpoint carries its round's row, re-appended on resume when
the kill fell between rename and append), and rounds after the last renamed checkpoint are recomputed, bit for bit.

Each row is chained to the run and to the rows before it (:mod:`fedlight.run.rows`), so an edited row is found.
TensorBoard leaves it too: creating the writer (importing TensorBoard), the config and partition (a matplotlib
picture), and each round's scalars and per-client histograms are jobs of the same thread, after the round's files.
"""

from __future__ import annotations

import contextlib
import errno
import sys
from pathlib import Path
from typing import Any

from fedlight.run import atomic, faults, side_files
from fedlight.run import files as records
from fedlight.run.background import CheckpointWriter
from fedlight.run.cleanup import clear
from fedlight.run.console import Progress, RoundWatch
from fedlight.run.directory import RunLock
from fedlight.run.rows import CHAIN, chained, dumps, strict, strict_row


class RunRecord:
    """Writes one run directory.

    Args:
        out_dir: the run directory.
        rank0: whether this process writes (global rank 0).
        rounds: the run's total rounds (for the progress display).
        progress: show a bar (terminal) or per-round lines (otherwise); ``False``: neither.
        hint: the likely cause named by the exploding-loss warning.
    """

    def __init__(self, out_dir: str | Path, rank0: bool = True, rounds: int = 0, progress: bool = True,
                 hint: str = "") -> None:
        self.out = Path(out_dir)
        self.rank0 = rank0
        self.rows: list[dict[str, Any]] = []
        self.lock = RunLock(self.out)
        self.writer = CheckpointWriter() if rank0 else None
        self.logger = None
        self.tensorboard = True  # whether the run writes TensorBoard (`loggers`); open() confirms it
        self.opened = False  # open() ran: the run's files are being written
        self.trackers = None  # MLflow, W&B, CSV, ... (fedlight.run.trackers.Trackers), fed beside TensorBoard
        self.progress = Progress(rounds, enabled=progress and rank0)
        self.watch = RoundWatch(hint)
        self.hparams: dict[str, Any] | None = None  # for TensorBoard's hparams table
        self.saved_round = 0  # rounds in the last checkpoint renamed into place (0: none yet)
        self.rotate = True  # keep last.ckpt as prev.ckpt when the next one is written (False: last.ckpt is damaged)
        self.run_id: str | None = None  # the run's identity (open()): each row is chained to it (fedlight.run.rows)
        self.chain_end = ""  # the chain digest of the last row handed over
        if self.writer is not None:
            faults.DRAIN.append(self.writer.wait)

    # ------------------------------------------------------------------------------------------ start
    def acquire(self, expected: tuple | None = None) -> None:
        """Lock the directory (global rank 0); ``expected``: see :meth:`RunLock.acquire`."""
        if self.rank0:
            self.lock.acquire(expected)

    def open(self, config_text: str | None, data: Any = None, overwrite: bool = False, fresh: bool = True,
             tensorboard: bool = True, run_id: str | None = None) -> None:
        """First writes of the run (after every check): clear on ``overwrite``, ``config.yaml`` (a fresh run only;
        with the run's identity ``run_id``), TensorBoard config and partition."""
        self.tensorboard, self.opened, self.run_id = tensorboard, True, run_id
        if not self.rank0:
            return
        with _disk_errors(self.out / "config.yaml"):
            if overwrite:
                clear(self.out)
            (self.out / "checkpoints").mkdir(parents=True, exist_ok=True)
            for folder in (self.out, self.out / "checkpoints"):  # torn writes of a killed run
                atomic.remove_leftovers(folder)
            if config_text is not None and (fresh or not (self.out / "config.yaml").exists()):
                atomic.atomic_write_text(self.out / "config.yaml", side_files.seal_config(config_text, run_id))
        if tensorboard:  # off the critical path: importing TensorBoard and drawing the partition take ~0.5 s
            self.writer.submit(lambda: self._tensorboard(lambda: self._open_tensorboard(config_text, data), 0))

    def summary_writer(self) -> Any:
        """The run's TensorBoard ``SummaryWriter`` (``RUN/tb``) once the record is open on global rank 0 with
        TensorBoard on, else ``None`` (a LightningModule's ``self.logger.experiment``)."""
        if not (self.rank0 and self.opened and self.tensorboard):
            return None
        if self.logger is None:
            self.writer.wait()  # opened in the background
        return self.logger.writer if self.logger is not None else None

    def _open_tensorboard(self, config_text: str | None, data: Any) -> None:
        from fedlight.run.tensorboard import RunLogger

        self.logger = RunLogger(self.out)
        self.logger.log_config(config_text or "")
        if data is not None:
            self.logger.log_partition(data)

    def begin(self, start_round: int, last_row: dict[str, Any] | None) -> None:
        """Align ``metrics.jsonl`` with the checkpoint the run starts from; start the progress display."""
        if self.rank0:
            log = records.MetricsLog(self.out / "metrics.jsonl")
            log.truncate_to(start_round)
            self.rows = log.rows
            self.chain_end = self.rows[-1].get(CHAIN, "") if self.rows else ""
            done = self.rows[-1]["round"] if self.rows else 0
            self.saved_round = start_round
            if last_row is not None and done < start_round:  # killed between checkpoint and metrics append
                self._append(self._seal(last_row))
            if self.trackers is not None:  # the rows a tracker lacks (a resumed run, a tracker added on resume)
                self.trackers.begin(self.rows)
            if start_round:
                print(f"fedlight: resumed from round {start_round} ({self.out})", file=sys.stderr, flush=True)
        self.watch.first_loss = next((r["train_loss"] for r in self.rows if r.get("train_loss") is not None), None)
        self.progress.start(start_round, self.rows)

    def phase(self, name: str, round: int) -> None:
        self.progress.phase(name, round)

    # ------------------------------------------------------------------------------------------ per round
    def round_done(self, row: dict[str, Any], checkpoint: dict[str, Any] | None = None) -> None:
        """Record a finished round: its checkpoint (a CPU snapshot, or ``None``; written as given — its author is
        :meth:`LoopState.snapshot <fedlight.engine.loop_state.LoopState.snapshot>` — but for ``last_row``, the row as
        written, chain digest included) then its metrics row (chained, :mod:`fedlight.run.rows`), in the background
        and in order (see the module docstring)."""
        if not self.rank0:
            return
        row = self._seal(strict_row(row))
        self.rows.append(row)
        if checkpoint is not None:  # it carries its round's row as written, chain digest included
            checkpoint = {**checkpoint, "last_row": dumps(row)}
            rounds_done = int(checkpoint["round"])
            self.writer.submit(lambda: self._write_checkpoint(checkpoint, rounds_done, row), exclusive=True)
        else:
            self.writer.submit(lambda: self._append(row, keep=False))
        self.writer.submit(lambda: self._tensorboard(lambda: self.logger.log_round(row, step=int(row["round"])),
                                                     int(row["round"])))  # in the background after the row's files
        if self.trackers is not None:  # once the round's checkpoint is renamed; sent on the trackers' own thread
            self.writer.submit(lambda: self.trackers.log_round(row, durable=checkpoint is not None))
        self.watch.check(row)
        self.progress.update(row)

    def _seal(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row`` with its chain digest, after the rows handed over before it (none without a run identity)."""
        if self.run_id is None:
            return row
        row = chained(row, self.run_id, self.chain_end)
        self.chain_end = row[CHAIN]
        return row

    def _write_checkpoint(self, state: dict[str, Any], rounds_done: int, row: dict[str, Any]) -> None:
        path = self.out / "checkpoints" / "last.ckpt"
        with _disk_errors(path):
            if not self.out.is_dir():  # removed during the run: do not make a new, partial run directory
                raise FileNotFoundError(errno.ENOENT, "the run directory was removed", str(self.out))
            atomic.atomic_torch_save(state, path, before_replace=lambda: faults.fault("ckpt", rounds_done),
                                     previous=path.with_name("prev.ckpt") if self.rotate else None)
        self.saved_round, self.rotate = rounds_done, True
        faults.fault("metrics", rounds_done)
        self._append(row, keep=False)

    def _tensorboard(self, job, round: int) -> None:
        """A TensorBoard job (once open, or the opening): a failed write is one RunDirError (exit 74, resumable);
        any other failure one warning line naming it, and the run goes on without TensorBoard."""
        from fedlight.run.stops import RunDirError
        from fedlight.run.trackers import warn_failed

        if self.logger is None and round:
            return
        try:
            with _disk_errors(self.out / "tb"):  # TensorBoard's thread raises a failed write without its file name
                job()
        except RunDirError:
            raise
        except Exception as e:  # noqa: BLE001 - a logger never ends a run
            warn_failed("TensorBoard", round, e, f"{self.out / 'tb'} holds the rounds before")
            logger, self.logger, self.tensorboard = self.logger, None, False
            if logger is not None:
                with contextlib.suppress(Exception):
                    logger.close()

    def _append(self, row: dict[str, Any], keep: bool = True) -> None:
        if keep:
            self.rows.append(row)
        with _disk_errors(self.out / "metrics.jsonl"):
            atomic.append_line(self.out / "metrics.jsonl", dumps(row))

    def flush(self) -> None:
        """Wait until every checkpoint and metrics line handed over so far is on disk."""
        if self.writer is not None:
            self.writer.wait()

    # ------------------------------------------------------------------------------------------ end
    def finish(self, summary: dict[str, Any], final_state: dict[str, Any] | None) -> None:
        """Wait for the writes in flight, then ``final_model.pt`` and ``summary.json`` (strict JSON)."""
        self.progress.close()
        if not self.rank0:
            return
        self.flush()
        if final_state is not None:
            with _disk_errors(self.out / "final_model.pt"):
                atomic.atomic_torch_save(final_state, self.out / "final_model.pt")
            summary["final_model_sha256"] = atomic.seal_of(self.out / "final_model.pt")  # binds it to this summary
        if self.trackers is not None:
            summary["trackers"] = self.trackers.report()  # run ids, rounds a failing tracker missed
        with _disk_errors(self.out / "summary.json"):
            atomic.atomic_write_text(self.out / "summary.json", side_files.seal_summary(strict(summary)))
        if self.logger is not None and self.hparams is not None:
            self._tensorboard(lambda: self.logger.log_summary(self.hparams, strict(summary)), -1)
        if self.trackers is not None:
            self.trackers.finish(strict(summary))

    def abort(self) -> None:
        """After a failed write: stop the progress display, the checkpoint writer and TensorBoard without letting
        them report the same failure again (:func:`fedlight.run.stops.disk_guard` reports it once)."""
        self.progress.close()
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.wait()
        if self.logger is not None:
            with contextlib.suppress(Exception):
                self.logger.close()
            self.logger = None

    def close(self, refused: bool = False, failing: bool = False) -> None:
        """Release everything; safe to call twice and after a failure. A failed write here (TensorBoard's last flush,
        the lock file's removal) is one RunDirError (exit 74) naming the file and the last checkpoint, unless the run
        already fails with its own error (``failing``), which stays the one reported."""
        from fedlight.run.stops import RunDirError, last_checkpoint

        try:
            self._close(refused)
        except (OSError, RunDirError) as e:
            if not failing:
                raise RunDirError((f"{e}" if isinstance(e, RunDirError) else f"cannot write {e.filename or self.out}: "
                                   f"{e.strerror or e}. Fix the folder (the lock file left there is taken over by "
                                   "the next run).") + f" {last_checkpoint(self)}") from None

    def _close(self, refused: bool) -> None:
        self.progress.close()
        if self.writer is not None:
            if self.writer.wait in faults.DRAIN:
                faults.DRAIN.remove(self.writer.wait)
            try:
                self.writer.close()
            finally:
                self.writer = None
                trackers, self.trackers = self.trackers, None
                if trackers is not None:  # after the record's jobs, which hand it rows
                    trackers.close()
                logger, self.logger = self.logger, None
                try:
                    if logger is not None:
                        with _disk_errors(self.out / "tb"):
                            logger.close()
                finally:
                    self.lock.release(refused=refused)


@contextlib.contextmanager
def _disk_errors(path: Path):
    """A failed write (disk full, folder removed, read-only remount) is one message, not a traceback."""
    from fedlight.run.stops import RunDirError

    try:
        yield
    except OSError as e:
        raise RunDirError(f"cannot write {path}: {e.strerror or e}. Free space or fix the folder, then continue with "
                          "`--resume auto`.") from None

"""Everything a run leaves behind or shows while it trains.

* :mod:`~fedlight.run.directory` — the run directory before the first byte: where it is, its lock, whether a resume
  may continue it (defining vs execution-only settings);
* :mod:`~fedlight.run.record` — :class:`RunRecord`, the one object that writes a run directory (background
  checkpoints, ``metrics.jsonl``, ``summary.json``);
* :mod:`~fedlight.run.atomic` — atomic file writes, sealed checkpoints (SHA-256 in the file) and their loading;
* :mod:`~fedlight.run.files` — ``metrics.jsonl`` reading (damaged lines named), checkpoint compatibility;
* :mod:`~fedlight.run.summary` — ``summary.json``: rounds to target, seconds per round, versions;
* :mod:`~fedlight.run.faults` — fault injection for the kill-, signal- and disk-safety tests;
* :mod:`~fedlight.run.verify` — ``fedlight verify RUN_DIR``;
* :mod:`~fedlight.engine.round_row` — :class:`RoundRow`, what one round reports;
* :mod:`~fedlight.run.console` — progress bar or lines and warnings;
* :mod:`~fedlight.run.tensorboard` — TensorBoard scalars, histograms, config and hparams.
* :mod:`~fedlight.run.stops` — clean stops on SIGTERM/SIGINT/SIGUSR1 and on failed writes, and the exit
  statuses of ``fedlight fit``.
"""

"""Everything a run leaves behind or shows while it trains.

* :mod:`~fedlight.run.directory` — the run directory before the first byte: where it is, its lock, whether a resume
  may continue it (defining vs execution-only settings);
* :mod:`~fedlight.run.record` — :class:`RunRecord`, the one object that writes a run directory (background
  checkpoints, ``metrics.jsonl``, ``summary.json``);
* :mod:`~fedlight.run.files` — atomic file writes, checkpoints, ``metrics.jsonl`` reading, versions;
* :mod:`~fedlight.run.round_row` — :class:`RoundRow`, what one round reports;
* :mod:`~fedlight.run.console` — progress bar or lines and warnings;
* :mod:`~fedlight.run.tensorboard` — TensorBoard scalars, histograms, config and hparams.
* :mod:`~fedlight.run.stops` — clean stops on SIGTERM/SIGINT/SIGUSR1 and on failed writes, and the exit
  statuses of ``fedlight fit``.
"""

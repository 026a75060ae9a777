"""Research tooling around the core, a package per family: :mod:`~fedlight.lab.tables` (reproduce paper tables,
report and plot runs), :mod:`~fedlight.lab.tuning` (built on the tables), :mod:`~fedlight.lab.benchmarks` and
:mod:`~fedlight.lab.flatness` (loss landscapes, sharpness).

Nothing in :mod:`fedlight`'s core imports this package; the CLI resolves its subcommands lazily.
"""

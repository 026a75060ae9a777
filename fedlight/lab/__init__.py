"""Research tooling around the core: reproduce paper tables, report and plot runs, probe loss landscapes, bench.

Nothing in :mod:`fedlight`'s core imports this package; the CLI resolves its subcommands lazily.
"""

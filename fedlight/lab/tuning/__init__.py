"""``fedlight tune``: each row's hyperparameters searched with Optuna on the same budget, as trials of a
table's cells (built on :mod:`fedlight.lab.tables`): the search space, the study and its workers,
``tune.md``.
"""

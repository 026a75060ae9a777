"""Paper tables: ``fedlight reproduce`` and ``fedlight report`` — a table spec's cells as ``fedlight fit``
runs on one job runner (local, Slurm, GPU sharing; ``job.json``), finished runs read back, ``table.md``
and the curves, and a study's best values for ``--tuned`` (:mod:`fedlight.lab.tables.studies`).
"""

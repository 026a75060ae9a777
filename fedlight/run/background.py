"""The run record's background writer: one thread that runs file jobs in order (checkpoints, metrics rows,
TensorBoard; a tracker's sends), so they leave the critical path (see :mod:`fedlight.run.record`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor


class CheckpointWriter:
    """One background thread that runs file jobs in order; :meth:`wait` re-raises a failed job's error."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedlight-record")
        self._jobs: list[Future] = []

    def submit(self, job, exclusive: bool = False) -> None:
        if exclusive:  # at most one checkpoint in flight
            self.wait()
        self._jobs.append(self._pool.submit(job))

    def wait(self) -> None:
        if threading.current_thread().name.startswith("fedlight-record"):
            return  # a fault hook fired inside a job
        jobs, self._jobs = self._jobs, []
        for j in jobs:
            j.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

"""A round's evaluation, checkpoint and writes done behind the next round's training, in order, by one thread.

The ServerApp hands each finished round's work (on the vectorized engine its
evaluation, then its checkpoint, then whatever shows the round: log line,
``metrics.json``, gauges) to :class:`WriteBehind` as one job and goes on with
the next round. Jobs run one at a time in the order
given, so a round is shown only after its own checkpoint and every earlier
round's writes; the first job that raises stops the rest (nothing after a failed
checkpoint is shown), and its error is raised in the caller at the next
:meth:`~WriteBehind.submit` or :meth:`~WriteBehind.drain`. At most
``depth`` jobs wait, so the writes lag the rounds by a bounded amount.

The caller closes it (:meth:`~WriteBehind.close`: drain, then end the worker)
before it returns or raises, so the interpreter never ends inside a job (a
job may run PyTorch: the server's evaluation of the round's model) and a
process that runs many runs (a sweep) keeps no idle workers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

Job = Callable[[], None]


class WriteBehind:
    """One worker thread that runs submitted jobs in order and stops at the first failure."""

    def __init__(self, depth: int = 2, name: str = "fedhog-writes") -> None:
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._worker = threading.Thread(target=self._work, name=name, daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` after the jobs before it (waits while ``depth`` jobs wait); raises an earlier job's error."""
        self._raise_failure()
        self._jobs.put(job)

    def drain(self) -> None:
        """Wait until every submitted job has run (or been skipped after a failure); raise the failure, if any."""
        self._jobs.join()
        self._raise_failure()

    def close(self) -> None:
        """Drain (raising a failure), then end the worker thread; nothing may be submitted after."""
        try:
            self.drain()
        finally:
            self._jobs.put(None)
            self._worker.join()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:  # close()
                self._jobs.task_done()
                return
            try:
                if self._error is None:
                    job()
            except BaseException as error:  # handed to the caller, which raises it
                self._error = error
            finally:
                self._jobs.task_done()

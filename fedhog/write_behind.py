"""A round's checkpoint and writes done behind the next round's training, in order, by one worker thread.

The ServerApp hands each finished round's writes (its checkpoint, then whatever
shows the round: log line, ``metrics.json``, gauges) to :class:`WriteBehind` as
one job and goes on with the next round. Jobs run one at a time in the order
given, so a round is shown only after its own checkpoint and every earlier
round's writes; the first job that raises stops the rest (nothing after a failed
checkpoint is shown), and its error is raised in the caller at the next
:meth:`~WriteBehind.submit` or :meth:`~WriteBehind.drain`. At most
``depth`` jobs wait, so the writes lag the rounds by a bounded amount.

A job does file I/O only (no PyTorch kernels): the interpreter may end while
the daemon worker is idle in ``queue.get``, never inside a job, because the
caller drains before it returns or raises.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

Job = Callable[[], None]


class WriteBehind:
    """One worker thread that runs submitted jobs in order and stops at the first failure."""

    def __init__(self, depth: int = 2, name: str = "fedhog-writes") -> None:
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=depth)
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

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if self._error is None:
                    job()
            except BaseException as error:  # handed to the caller, which raises it
                self._error = error
            finally:
                self._jobs.task_done()

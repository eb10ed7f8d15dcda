"""ε after n releases of one fixed event, computed ahead of the rounds that need it.

σ and q do not change during a run, so ε after n rounds is a function of n
alone. Composing it takes a PLD self-convolution (tens of milliseconds) that
would otherwise sit inside every round; :class:`EpsilonSchedule` computes the
next planned values in a background thread while the round trains, and hands
each one over when the round asks. The thread waits for the next values and
ends after :data:`IDLE_SECONDS` without any, so a run of short rounds starts it
once, not every round (a thread's start stalls the caller until the new thread
lets go of the GIL: milliseconds). A value is the one its function returns,
whichever thread computed it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

LOOKAHEAD = 2  # values computed ahead of the last one asked for: the work left over when a run stops early
IDLE_SECONDS = 1.0  # the worker ends after this long without a value to compute


class EpsilonSchedule:
    """Memoised ``epsilon_after(n)`` that computes the next planned values in the background.

    Parameters
    ----------
    epsilon_after : callable
        ε after n releases; pure (the same n gives the same float).
    """

    def __init__(self, epsilon_after: Callable[[int], float]) -> None:
        self._epsilon_after = epsilon_after
        self._values: dict[int, float] = {}
        self._changed = threading.Condition()
        self._planned: range = range(0)
        self._worker: threading.Thread | None = None
        self._working_on: frozenset[int] = frozenset()
        self._failure: BaseException | None = None

    def plan(self, first: int, last: int) -> None:
        """Plan ε after ``first``..``last`` releases: the first values start computing now, in the background."""
        with self._changed:
            self._planned = range(max(first, 1), last + 1)
            self._failure = None
        self._compute_ahead(self._planned.start - 1)

    def __call__(self, releases: int) -> float:
        """ε after ``releases`` releases (waiting for the background thread where it is computing it)."""
        with self._changed:
            while releases not in self._values and releases in self._working_on:
                self._changed.wait()
            value = self._values.get(releases)
        if value is None:  # not planned, or the worker failed on it: compute it here (and raise what it raises)
            value = self._epsilon_after(releases)
            with self._changed:
                self._values[releases] = value
        self._compute_ahead(releases)
        return value

    def _compute_ahead(self, releases: int) -> None:
        """Hand the worker the planned values after ``releases`` not known yet (at most :data:`LOOKAHEAD`): wake it,
        or start one."""
        with self._changed:
            if self._failure is not None:
                return
            ahead = [n for n in range(releases + 1, releases + 1 + LOOKAHEAD)
                     if n in self._planned and n not in self._values]
            if not ahead:
                return
            self._working_on = self._working_on | frozenset(ahead)
            if self._worker is not None:
                self._changed.notify_all()
                return
            self._worker = threading.Thread(target=self._work, daemon=True, name="fedhog-epsilon-schedule")
            self._worker.start()

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._working_on:
                    if not self._changed.wait(IDLE_SECONDS) and not self._working_on:
                        self._worker = None  # under the lock: the next value asked for starts a new worker
                        return
                releases = min(self._working_on)
            try:
                value = self._epsilon_after(releases)
            except BaseException as error:  # pylint: disable=broad-except  # the caller recomputes, and sees it raise
                with self._changed:
                    self._failure = error
                    self._working_on = frozenset()
                    self._worker = None
                    self._changed.notify_all()
                return
            with self._changed:
                self._values.setdefault(releases, value)
                self._working_on = self._working_on - {releases}
                self._changed.notify_all()

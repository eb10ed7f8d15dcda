"""Ctrl-C and SIGTERM: a run stops where it is, and what it finished stays on disk.

:func:`handled` turns SIGINT into :class:`KeyboardInterrupt` and SIGTERM into
``SystemExit(143)`` (as :mod:`fedhog.deploy` does), raised in the main thread,
where fedhog runs its in-process engines: the exception unwinds through the
engine, so nothing keeps running. (The engines used to run in a daemon thread
while the main thread returned: the interpreter then shut down under a thread
that was inside PyTorch's C++ code, and that thread's forced unwinding ended
the process with ``terminate called without an active exception``, exit 134.)

:func:`deferred` marks a block that must not be cut in half (writing a round's
metrics and its checkpoint): a signal that arrives inside it is raised when the
block ends.

Signal handlers belong to the process's owner: only :func:`handled` (the ``fedhog``
command's ``main``) installs them, for the run, and restores the previous ones after;
library code changes them only inside it (:func:`rerouted`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State(threading.local):
    depth = 0  # how many deferred blocks the main thread is in
    pending = 0  # the signal that arrived inside one, 0 if none


_state = _State()


def interrupt_exit_code(error: BaseException) -> int | None:
    """The exit status for an interrupt (130 for Ctrl-C, 143 for SIGTERM); None for any other exception."""
    if isinstance(error, KeyboardInterrupt):
        return 128 + signal.SIGINT
    if isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM:
        return 128 + signal.SIGTERM
    return None


def _raise(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _handler(signum: int, frame: object) -> None:
    if _state.depth:
        _state.pending = _state.pending or signum
        return
    _raise(signum)


@contextmanager
def handled() -> Iterator[None]:
    """Inside the block SIGINT raises KeyboardInterrupt and SIGTERM SystemExit(143), except inside :func:`deferred`.

    Only the main thread can handle signals; elsewhere this is a no-op. The
    previous handlers come back when the block ends.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, signal.SIG_DFL if old is None else old)


@contextmanager
def deferred() -> Iterator[None]:
    """Run the block whole: a signal handled by :func:`handled` that arrives inside it is raised when it ends."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending:
            signum, _state.pending = _state.pending, 0
            _raise(signum)


def in_force() -> bool:
    """Whether :func:`handled` is in force here: the main thread, with its handler on SIGINT and SIGTERM."""
    return threading.current_thread() is threading.main_thread() and all(
        signal.getsignal(signum) is _handler for signum in SIGNALS)


@contextmanager
def rerouted(handler: signal.Handlers | Callable[[int, Any], None]) -> Iterator[None]:
    """While :func:`handled` is in force, SIGINT and SIGTERM go to ``handler`` inside the block (then back).

    Outside it nothing changes: a library call (:func:`fedhog.deploy.deploy_local` from a test suite, a notebook,
    another program) leaves its caller's handlers alone, so SIGTERM does there what the caller made it do.
    """
    if not in_force():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def ignore() -> None:
    """Ignore SIGINT and SIGTERM from now on (until :func:`handled` restores the handlers); main thread only."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)

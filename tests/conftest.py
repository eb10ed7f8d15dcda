"""Fixtures the test files share, and the fast tier's time in the terminal summary.

Markers (``--strict-markers``: an unknown one is an error): ``slow`` for tests that start a real Flower
engine, Ray, a deployment, a wheel install, or take more than a few seconds; ``subprocess`` for tests that
start processes. ``pytest -m "not slow"`` is the developer's loop; CI runs everything (``pytest``).
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest

# Flower's console handler writes to the sys.stderr of the moment Flower is first imported: imported inside a test
# that captures output (capsys), it would keep that test's stream, closed when the test ends, and every later test
# would print a "Logging error" traceback. Imported here, it keeps the session's stream.
import flwr.common.logger  # noqa: F401  isort: skip


@pytest.fixture
def shared_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$FEDHOG_CACHE`` in the session's temporary folder: data generated once serves every test that asks."""
    path = tmp_path_factory.getbasetemp() / "cache"
    monkeypatch.setenv("FEDHOG_CACHE", str(path))
    return path


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``$FEDHOG_CACHE`` of this test alone: no client state (accountants) or data left by another test."""
    path = tmp_path / "cache"
    monkeypatch.setenv("FEDHOG_CACHE", str(path))
    return path


@pytest.fixture
def private_dirs(shared_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The shared cache, and Flower's and Ray's folders in the session's temporary folder, never ``~/.flwr``."""
    base = tmp_path_factory.getbasetemp()
    monkeypatch.setenv("FLWR_HOME", str(base / "flwr-home-unused"))
    monkeypatch.setenv("RAY_TMPDIR", str(base / "ray"))


@pytest.fixture
def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages take run and sender from the task identity, as in a ServerApp process."""
    from flwr.common.constant import SUPERLINK_NODE_ID  # Flower loads only for the tests that ask
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", SUPERLINK_NODE_ID)


# --- the tier's time: wall clock and the CPU seconds of pytest and the processes it waited for ---
_START: dict[str, float] = {}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    _START.update(wall=time.perf_counter(), cpu=_cpu_seconds())


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    if not _START:
        return
    wall, cpu = time.perf_counter() - _START["wall"], _cpu_seconds() - _START["cpu"]
    tier = config.getoption("markexpr") or "all tests"
    budget = " (the fast tier should stay under 180 s on 2 idle cores)" if tier == "not slow" else ""
    terminalreporter.write_line(f"fedhog tests ({tier}): {wall:.0f} s wall, {cpu:.0f} s CPU{budget}")

"""Find the processes a command started, however they detached: by an environment variable they all inherit."""

from __future__ import annotations

import uuid

import psutil

TAG = "FEDHOG_TEST_TAG"


def new_tag() -> dict[str, str]:
    """An environment entry to give a command: every process it starts inherits it."""
    return {TAG: uuid.uuid4().hex}


def tagged(tag: dict[str, str]) -> dict[int, tuple[str, str]]:
    """Live (not zombie) processes carrying ``tag``: pid -> (command line, working directory)."""
    found = {}
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG) != tag[TAG] or process.status() == psutil.STATUS_ZOMBIE:
                continue
            found[process.pid] = (" ".join(process.cmdline()), process.cwd())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found

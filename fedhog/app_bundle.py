"""The Flower app bundle that ``flwr run`` submits, written at run time.

``flwr run <folder>`` needs a ``pyproject.toml`` with ``[tool.flwr.app]`` in
``<folder>``; it zips the folder into a FAB and the SuperLink's ServerApp and
ClientApp processes load ``fedhog.server_app:app`` and ``fedhog.client_app:app``
by name. A folder holding that file alone is enough: the apps are imported from
the environment that runs the SuperLink, which is fedhog's own however it was
installed (editable, ``pip install .``, pipx). So fedhog never depends on a
checkout being beside the package: :func:`write_app_bundle` writes the file
into a private folder for each run.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .config import RunConfig, toml_value

PUBLISHER = "fedhog"
SERVER_APP = "fedhog.server_app:app"
CLIENT_APP = "fedhog.client_app:app"


def fedhog_version() -> str:
    """The installed distribution's version (``0.0.0`` when running from a bare source tree)."""
    try:
        return version("fedhog")
    except PackageNotFoundError:
        return "0.0.0"


def app_pyproject() -> str:
    """``pyproject.toml`` of the Flower app: metadata, components, every run-config key with its default."""
    lines = [
        "# Written by fedhog for one `flwr run`; the apps are imported from the installed fedhog.",
        "[project]",
        'name = "fedhog"',
        f"version = {toml_value(fedhog_version())}",
        'description = "fedhog\'s ServerApp and ClientApp, imported from the installed fedhog"',
        'license = "Apache-2.0"',
        "dependencies = []",
        "",
        "[tool.flwr.app]",
        f"publisher = {toml_value(PUBLISHER)}",
        "",
        "[tool.flwr.app.components]",
        f"serverapp = {toml_value(SERVER_APP)}",
        f"clientapp = {toml_value(CLIENT_APP)}",
        "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{key} = {toml_value(value)}" for key, value in RunConfig().to_mapping().items()]
    return "\n".join(lines) + "\n"


def write_app_bundle(directory: Path) -> Path:
    """Write the app's ``pyproject.toml`` into ``directory`` (created); return the folder for ``flwr run``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pyproject.toml").write_text(app_pyproject(), encoding="utf-8")
    return directory

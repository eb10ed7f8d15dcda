"""The README's snippets work: every ```python block runs, every `fedhog` command line parses and its config
validates."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from fedhog.cli import build_parser
from fedhog.config import load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _blocks(language: str) -> list[tuple[str, str]]:
    """(heading above it, code) of every fenced block of ``language``; the code keeps its README line numbers."""
    text = README.read_text(encoding="utf-8")
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if match.group(1) == language:
            headings = re.findall(r"^#+ (.+)$", text[:match.start()], re.M)
            padding = "\n" * text.count("\n", 0, match.start(2))  # tracebacks name README's lines
            found.append((headings[-1] if headings else "top", padding + match.group(2)))
    return found


def _commands() -> list[tuple[str, list[str]]]:
    """The ``fedhog ...`` command lines of the README's bash blocks, as argument lists (comments dropped)."""
    commands = []
    for heading, code in _blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["fedhog"]:
                    commands.append((heading, words[1:]))
    return commands


PYTHON_BLOCKS = _blocks("python")
COMMANDS = _commands()


def test_the_readme_has_snippets_to_check():
    assert PYTHON_BLOCKS and len(COMMANDS) >= 8


@pytest.mark.parametrize("code", [code for _, code in PYTHON_BLOCKS],
                         ids=[f"{i}-{heading}" for i, (heading, _) in enumerate(PYTHON_BLOCKS)])
def test_python_snippet_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[" ".join(args)[:60] for _, args in COMMANDS])
def test_command_line_parses_and_its_config_validates(args, monkeypatch):
    monkeypatch.chdir(ROOT)  # README commands run in a checkout
    parsed = build_parser().parse_args(args)
    if parsed.command not in ("run", "deploy-local") or parsed.resume:
        return
    config_file = Path(parsed.config) if parsed.config else ROOT / "fedhog" / "quickstart.toml"
    if not config_file.exists():  # my.toml: the reader's own file
        config_file = None
    load_config(config_file, dict(parse_override(o) for o in parsed.overrides))

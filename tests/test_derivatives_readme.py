"""The code in the README section "Higher-order derivatives" runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _section_snippets() -> list[str]:
    text = README.read_text(encoding="utf-8")
    start = text.index("\n## Higher-order derivatives\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else None]
    return re.findall(r"```python\n(.*?)```", section, flags=re.DOTALL)


def test_readme_snippet_runs_as_written():
    snippets = _section_snippets()
    assert snippets, "the section has a python example"
    namespace: dict = {}
    exec(compile(snippets[0], str(README), "exec"), namespace)
    model, res, d = namespace["model"], namespace["res"], namespace["d"]
    # direction and res.vector are dicts keyed by parameter name
    assert set(res.vector) == {name for name, _ in model.named_parameters()} == set(namespace["direction"])
    assert res.finite and res.method == "taylor"
    assert d.values.shape == (6,) and torch.isfinite(d.values).all()

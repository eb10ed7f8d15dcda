"""The code of the manual's page "Higher-order derivatives" (docs/manual/derivatives.md) runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import torch

PAGE = Path(__file__).resolve().parents[1] / "docs" / "manual" / "derivatives.md"


def _section_snippets() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    assert text.startswith("# Higher-order derivatives\n")
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def test_the_pages_snippet_runs_as_written():
    snippets = _section_snippets()
    assert snippets, "the section has a python example"
    namespace: dict = {}
    exec(compile(snippets[0], str(PAGE), "exec"), namespace)
    model, res, d = namespace["model"], namespace["res"], namespace["d"]
    # direction and res.vector are dicts keyed by parameter name
    assert set(res.vector) == {name for name, _ in model.named_parameters()} == set(namespace["direction"])
    assert res.finite and res.method == "taylor"
    assert d.values.shape == (6,) and torch.isfinite(d.values).all()

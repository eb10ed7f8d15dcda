"""mkdocs hook: one API reference page per module of ``fedhog``, found by walking the package at build time.

Nothing lists the modules by hand, so a module that is added, moved or removed changes the reference at the
next build. Each page is a mkdocstrings ``:::`` block (rendered from the source by griffe, without importing
fedhog); ``reference/index.md`` lists every module with the first line of its docstring; the nav entry
``API reference`` of ``mkdocs.yml`` is replaced by the pages, a package's modules under the package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

PACKAGE = "fedhog"
NAV_TITLE = "API reference"
INDEX = "reference/index.md"
ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|exc|data|obj):<code>~?")  # Sphinx's :func:`x`, as rendered
PIPE, ESCAPED_PIPE = "|", "\\|"  # a docstring's | would end the table cell


def _root(config: MkDocsConfig) -> Path:
    return Path(config.config_file_path).resolve().parent / PACKAGE


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name → source file, for every module and package under ``root``, sorted by name."""
    found = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return dict(sorted(found.items()))


def _page(name: str) -> str:
    return f"reference/{name}.md"


def _summary(path: Path) -> str:
    docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    return docstring.strip().splitlines()[0] if docstring.strip() else ""


def _nav(names: list[str]) -> list:
    """The reference's nav: the index, then each module; a package's modules nested under its own page."""
    tree: list = [INDEX]
    sections: dict[str, list] = {}
    packages = {n for n in names if any(other.startswith(n + ".") for other in names)}
    for name in names:
        parent = name.rpartition(".")[0]
        entry = {name: _page(name)}
        if name in packages and name != PACKAGE:
            children = sections[name] = [entry]
            (sections.get(parent, tree)).append({name: children})
        else:
            sections.get(parent, tree).append(entry)
    return tree


def on_config(config: MkDocsConfig) -> MkDocsConfig:
    names = list(_modules(_root(config)))
    for item in config.nav or []:
        if isinstance(item, dict) and NAV_TITLE in item:
            item[NAV_TITLE] = _nav(names)
    return config


def on_files(files: Files, config: MkDocsConfig) -> Files:
    modules = _modules(_root(config))
    rows = [f"| [`{name}`]({name}.md) | {_summary(path).replace(PIPE, ESCAPED_PIPE)} |"
            for name, path in modules.items()]
    index = "\n".join([
        "# API reference", "",
        f"Generated at build time from the docstrings of every module of `{PACKAGE}` "
        "(`docs/hooks/api_reference.py` walks the package, so a moved or new module appears here without edits).",
        "", "| module | what it is |", "|---|---|", *rows, ""])
    files.append(File.generated(config, INDEX, content=index))
    for name in modules:
        files.append(File.generated(config, _page(name), content=f"# `{name}`\n\n::: {name}\n"))
    return files


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Docstrings written in Sphinx's markup: ``:func:`x``` shows as ``x``, a literal block's ``::`` as ``:``."""
    if not page.file.src_uri.startswith("reference/"):
        return html
    return ROLE.sub("<code>", html).replace("::</p>", ":</p>")

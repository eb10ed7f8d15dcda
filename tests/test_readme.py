"""The README's and the docs pages' snippets work and their links resolve.

Every ```python block runs, every `fedhog` command line parses and its config validates, and every relative
link and `#anchor` of README.md and docs/**/*.md points at a file and a heading that exist.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from pathlib import Path

import pytest

from fedhog.cli import build_parser
from fedhog.config import load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"^ *```.*?^ *```[^\n]*$", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _generated(docs: Path) -> set[Path]:
    """The pages docs/hooks/api_reference.py writes at build time: reference/index.md and one per module."""
    package = ROOT / "fedhog"
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
               for p in package.rglob("*.py")}
    return {docs / "reference" / f"{name}.md" for name in ["index", *modules]}


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _blocks(language: str) -> list[tuple[str, str, Path]]:
    """(page: heading above it, code, page) of every fenced block of ``language``; the code keeps its page's line
    numbers."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
            if match.group(1) == language:
                headings = re.findall(r"^#+ (.+)$", text[:match.start()], re.M)
                padding = "\n" * text.count("\n", 0, match.start(2))  # tracebacks name the page's lines
                label = f"{_name(page)}: {headings[-1] if headings else 'top'}"
                found.append((label, padding + match.group(2), page))
    return found


def _commands() -> list[tuple[str, list[str]]]:
    """The ``fedhog ...`` command lines of the pages' bash blocks, as argument lists (comments dropped)."""
    commands = []
    for heading, code, _ in _blocks("bash"):
        for line in code.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["fedhog"]:
                    commands.append((heading, words[1:]))
    return commands


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it, and the site (mkdocs.yml: pymdownx.slugs, case lower): the text
    without markup, lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]*>", "", text.replace("`", "").replace("*", ""))
    text = unicodedata.normalize("NFC", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> list[str]:
    """The anchors of a page's headings, in order (headings inside fenced code are not headings)."""
    prose = FENCE.sub("", page.read_text(encoding="utf-8"))
    return [slug(h) for h in re.findall(r"^#{1,6} +(.+?) *#*$", prose, re.M)]


def broken_links(page: Path, docs: Path = DOCS) -> list[str]:
    """Every relative link or image of ``page`` whose file or ``#anchor`` does not exist, as 'target: why'.

    A docs page may link only inside docs/ (mkdocs builds nothing else); the API reference's pages, which the
    build generates, exist if their module does; links in code are not links."""
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text(encoding="utf-8")))
    broken, generated = [], _generated(docs)
    for target in LINK.findall(prose):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if file in generated:  # mkdocs --strict checks their anchors
            continue
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif page.is_relative_to(docs) and not file.is_relative_to(docs):
            broken.append(f"{target}: outside docs/, which the site does not build")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file)):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {_name(file)}")
    return broken


PYTHON_BLOCKS = _blocks("python")
COMMANDS = _commands()


def test_the_pages_have_snippets_to_check():
    assert PYTHON_BLOCKS and len(COMMANDS) >= 8
    assert len(PAGES) > 1, "docs/ has pages"


@pytest.mark.parametrize("code,page", [(code, page) for _, code, page in PYTHON_BLOCKS],
                         ids=[f"{i}-{heading}" for i, (heading, _, _) in enumerate(PYTHON_BLOCKS)])
def test_python_snippet_runs(code, page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a snippet that writes files writes them here
    exec(compile(code, str(page), "exec"), {"__name__": "__readme__"})


@pytest.mark.parametrize("args", [args for _, args in COMMANDS], ids=[" ".join(args)[:60] for _, args in COMMANDS])
def test_command_line_parses_and_its_config_validates(args, monkeypatch):
    monkeypatch.chdir(ROOT)  # the pages' commands run in a checkout
    parsed = build_parser().parse_args(args)
    if parsed.command not in ("run", "deploy-local") or parsed.resume:
        return
    config_file = Path(parsed.config) if parsed.config else ROOT / "fedhog" / "quickstart.toml"
    if not config_file.exists():  # my.toml: the reader's own file
        config_file = None
    load_config(config_file, dict(parse_override(o) for o in parsed.overrides))


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=[_name(p) for p in PAGES])
def test_no_two_headings_of_a_page_share_an_anchor(page):
    """GitHub numbers a repeated anchor -1, mkdocs _1: a link to one would resolve on one of them only."""
    found = anchors(page)
    assert sorted({a for a in found if found.count(a) > 1}) == []


def test_the_link_check_finds_missing_files_and_anchors_and_links_out_of_docs(tmp_path):
    docs = tmp_path / "docs"
    (docs / "manual").mkdir(parents=True)
    (tmp_path / "configs.toml").write_text("")
    (docs / "manual" / "other.md").write_text("# Other\n\n## The mechanism, exactly\n\n```bash\n# not a heading\n```\n")
    page = docs / "manual" / "page.md"
    fine = ("[a](other.md#the-mechanism-exactly) [b](#page) ![c](other.md) [d](https://x.org) "
            "[e](../reference/fedhog.config.md)")
    broken = ["missing.md", "other.md#not-a-heading", "#nowhere", "../../configs.toml",
              "../reference/fedhog.nothing.md"]
    in_code = "`[f](missing.md)`\n\n```\n[g](missing.md)\n```\n"
    page.write_text(f"# Page\n\n{fine}\n" + " ".join(f"[x]({target})" for target in broken) + f"\n{in_code}")
    assert [b.split(": ")[0] for b in broken_links(page, docs)] == broken


def test_slugs_are_githubs():
    """Anchors GitHub gives these README headings (the README linked them so before the site existed)."""
    assert slug('Distributed noise (`noise = "distributed"`)') == "distributed-noise-noise--distributed"
    assert slug("Secure aggregation: the server learns only the sum") == \
        "secure-aggregation-the-server-learns-only-the-sum"
    assert slug("Threat model: who learns what") == "threat-model-who-learns-what"
    assert slug("Privacy–utility at convergence") == "privacyutility-at-convergence"

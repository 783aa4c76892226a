"""The code blocks of the docs, as a test runs them: docs that cannot rot.

Every ```python and ```bash (or sh, shell, console) fence in README.md and docs/ is run
by tests/docs/test_code_blocks.py, page by page, in the page's order, in a fresh
directory (with examples/ and bench/ of this checkout beside it): a page's Python blocks
share one namespace, as a reader who types them in one session would, and its shell
blocks see the files the blocks before made. A block whose lines start with `$ ` runs
only those lines (the rest is output shown to the reader); otherwise the whole block is
the script.

What a block should do differently under test is said in HTML comments, invisible on the
site, on the lines right above its fence:

    <!-- docs-test: skip: REASON -->           not run, and REASON says why (required)
    <!-- docs-test: replace "OLD" "NEW" ... --> run with OLD replaced by NEW (small sizes)
    <!-- docs-test: exits N -->                 the shell block's commands are expected to exit N
    <!-- docs-test: timeout SECONDS -->         the page may take longer than the default

and, on a line of its own anywhere in a page, `<!-- docs-test: continues PAGE -->`: the
page's blocks run after PAGE's (a guide that goes on from the quick start; PAGE is a
path relative to the page, as a link is). A snippet
line (`--8<-- "FILE"`, `"FILE:SECTION"` or `"FILE:START:END"`, as pymdownx.snippets reads
it) is read as the lines it brings in, so the blocks run are those a reader sees.

Other fences (text, yaml, json, dot) are what a program printed or reads, and are not run.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_LANGUAGES = {
    "python": "python",
    "py": "python",
    "bash": "shell",
    "sh": "shell",
    "shell": "shell",
    "console": "shell",
}
PAGE_TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_SNIPPET = re.compile(r'^--8<-- "(?P<file>[^":]+)(?::(?P<rest>[^"]*))?"\s*$')
_SECTION = re.compile(r"--8<-- \[(?P<edge>start|end):(?P<name>[\w-]+)\]")


class DocsBlockError(ValueError):
    """A docs page whose directives cannot be read: names the page and line."""


@dataclass(frozen=True)
class Line:
    """A line of a page as a reader sees it, and where it is written (a snippet's file)."""

    text: str
    source: Path
    number: int


@dataclass
class Block:
    """One fenced block; `source` and `line` say where its first code line is written."""

    page: str
    source: Path
    line: int
    language: str  # "python" or "shell"
    code: str
    skip: str | None = None
    replacements: list[tuple[str, str]] = field(default_factory=list)
    exits: int = 0

    def runnable_code(self) -> str:
        code = self.code
        for old, new in self.replacements:
            if old not in code:
                raise DocsBlockError(f"{self.page}:{self.line}: replace {old!r}: not in the block")
            code = code.replace(old, new)
        return code


@dataclass
class Page:
    path: str  # relative to the checkout, as messages name it
    root: Path
    blocks: list[Block]
    timeout: float = PAGE_TIMEOUT_S
    continues: str | None = None  # a page whose blocks run first

    @property
    def run(self) -> list[Block]:
        return [b for b in self.blocks if b.skip is None]


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def parse_page(path: Path, root: Path = ROOT) -> Page:
    """The runnable fences of one markdown page with their directives."""
    name = str(path.relative_to(root))
    lines = read_lines(path, root, name)
    page = Page(name, root, [])
    directives: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        text = lines[i].text
        if (d := _DIRECTIVE.match(text)) is not None:
            if d["body"].startswith("continues "):
                page.continues = d["body"].removeprefix("continues ").strip()
            else:
                directives.append((i + 1, d["body"]))
            i += 1
            continue
        fence = _FENCE.match(text)
        if fence is None:
            if text.strip():
                _no_stray_directives(name, directives)
                directives = []
            i += 1
            continue
        ticks, indent = fence["ticks"], fence["indent"]
        language = (fence["info"].split() or [""])[0].lower()
        end = i + 1
        while end < len(lines) and not lines[end].text.strip().startswith(ticks):
            end += 1
        if end == len(lines):
            raise DocsBlockError(f"{name}:{i + 1}: a fence that is never closed")
        code = "\n".join(line.text.removeprefix(indent) for line in lines[i + 1 : end])
        if language in RUN_LANGUAGES:
            first = lines[min(i + 1, len(lines) - 1)]
            block = Block(name, first.source, first.number, RUN_LANGUAGES[language], code)
            for line_number, body in directives:
                _apply(block, page, body, f"{name}:{line_number}")
            page.blocks.append(block)
        else:
            _no_stray_directives(name, directives)
        directives = []
        i = end + 1
    _no_stray_directives(name, directives)
    return page


def read_lines(path: Path, root: Path, page: str) -> list[Line]:
    """A page's lines with each snippet line replaced by the lines it brings in."""
    out: list[Line] = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        found = _SNIPPET.match(text)
        if found is None:
            out.append(Line(text, path.resolve(), number))
            continue
        source = (root / found["file"]).resolve()
        if not source.exists():
            raise DocsBlockError(f"{page}:{number}: snippet {found['file']!r} does not exist")
        numbered = list(enumerate(source.read_text(encoding="utf-8").splitlines(), 1))
        rest = found["rest"] or ""
        if rest and not rest.replace(":", "").isdigit():  # a named section
            edges = {(m["edge"], m["name"]): i for i, t in numbered if (m := _SECTION.search(t))}
            if ("start", rest) not in edges or ("end", rest) not in edges:
                raise DocsBlockError(f"{page}:{number}: {found['file']} has no section {rest!r}")
            numbered = numbered[edges["start", rest] : edges["end", rest] - 1]
        elif rest:
            start, _, end = rest.partition(":")
            numbered = numbered[int(start or 1) - 1 : int(end) if end else None]
        out.extend(Line(t, source, n) for n, t in numbered if not _SECTION.search(t))
    return out


def _no_stray_directives(page: str, directives: list[tuple[int, str]]) -> None:
    if directives:
        line, body = directives[0]
        raise DocsBlockError(f"{page}:{line}: 'docs-test: {body}' is not right above a python or shell fence")


def _apply(block: Block, page: Page, body: str, where: str) -> None:
    key, _, rest = body.partition(" ")
    key = key.rstrip(":")
    if key == "skip":
        reason = rest.strip().removeprefix(":").strip()
        if not reason:
            raise DocsBlockError(
                f"{where}: 'docs-test: skip' needs a reason: 'docs-test: skip: why it is not run'"
            )
        block.skip = reason
    elif key == "replace":
        words = shlex.split(rest)
        if not words or len(words) % 2:
            raise DocsBlockError(f'{where}: replace takes pairs of quoted strings: replace "OLD" "NEW"')
        block.replacements += list(zip(words[::2], words[1::2], strict=True))
    elif key == "exits":
        block.exits = int(rest)
    elif key == "timeout":
        page.timeout = float(rest)
    else:
        raise DocsBlockError(f"{where}: unknown directive {key!r} (skip, replace, exits, timeout, continues)")


def shell_commands(code: str) -> str:
    """The script a shell block runs: its `$ ` lines (with their `\\` continuations) when it
    has any, else the whole block."""
    lines = code.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        return code
    commands, continuing = [], False
    for line in lines:
        if line.startswith("$ ") or continuing:
            command = line[2:] if line.startswith("$ ") and not continuing else line
            commands.append(command)
            continuing = command.rstrip().endswith("\\")
    return "\n".join(commands)


def blocks_to_run(page: Page) -> list[Block]:
    """The page's blocks to run, after those of the page it continues (and its own)."""
    if page.continues is None:
        return page.run
    first = (page.root / page.path).parent / page.continues  # (relative to the page, as a link is)
    if not first.exists():
        raise DocsBlockError(f"{page.path}: it continues {page.continues!r}, which does not exist")
    return [*blocks_to_run(parse_page(first, page.root)), *page.run]


def page_script(page: Page) -> str:
    """What the page runner (tests/docs_runner.py) reads: the blocks to run, as JSON."""
    blocks = [
        {
            "source": str(b.source),
            "line": b.line,
            "language": b.language,
            "code": b.runnable_code() if b.language == "python" else shell_commands(b.runnable_code()),
            "exits": b.exits,
        }
        for b in blocks_to_run(page)
    ]
    return json.dumps({"page": page.path, "blocks": blocks})

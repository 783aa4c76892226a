"""Docs that cannot rot: every python and shell block of README.md and docs/ runs, page
by page, or says why it does not (tests/docs_blocks.py has the rules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import ROOT, DocsBlockError, doc_pages, page_script, parse_page

RUNNER = Path(__file__).resolve().parents[1] / "docs_runner.py"
PAGES = [p for p in doc_pages() if parse_page(p).run]


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_a_pages_code_blocks_run_in_order(path, tmp_path):
    page = parse_page(path)
    for shared in ("examples", "bench"):  # what the blocks' commands name, as in a checkout
        (tmp_path / shared).symlink_to(ROOT / shared)
    (tmp_path / "blocks.json").write_text(page_script(page))
    bin_dir = str(Path(sys.executable).parent)  # the `fluidps` command of this environment
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            [sys.executable, str(RUNNER), "blocks.json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=page.timeout,
            check=False,
            start_new_session=True,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"{page.path}: its blocks did not finish in {page.timeout:.0f} s\n{(e.stdout or '')[-3000:]}"
        )
    assert done.returncode == 0, f"{page.path}:\n{done.stdout[-6000:]}\n{done.stderr[-6000:]}"


def test_every_block_that_is_not_run_says_why():
    skipped = [b for p in doc_pages() for b in parse_page(p).blocks if b.skip is not None]
    assert all(len(b.skip) >= 10 for b in skipped), [f"{b.page}:{b.line}: {b.skip}" for b in skipped]


def test_a_directive_that_names_nothing_is_an_error(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "p.md"
    page.write_text("<!-- docs-test: skip -->\n```python\nprint(1)\n```\n")
    with pytest.raises(DocsBlockError, match="needs a reason"):
        parse_page(page, tmp_path)
    page.write_text("<!-- docs-test: skip: a reason -->\n\nSome prose.\n")
    with pytest.raises(DocsBlockError, match="not right above"):
        parse_page(page, tmp_path)
    page.write_text('<!-- docs-test: replace "9" "1" -->\n```python\nprint(2)\n```\n')
    with pytest.raises(DocsBlockError, match="not in the block"):
        page_script(parse_page(page, tmp_path))


def test_shell_blocks_run_their_prompted_lines_and_python_blocks_share_a_namespace(tmp_path):
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "p.md"
    page.write_text(
        "```python\nx = 41\n```\n\ntext\n\n```python\nopen('out.txt', 'w').write(str(x + 1))\n```\n\n"
        '```console\n$ test "$(cat out.txt)" = 42 && \\\n  echo ok\nok\n```\n\n'
        "<!-- docs-test: exits 3 -->\n```bash\nexit 3\n```\n"
    )
    (tmp_path / "blocks.json").write_text(page_script(parse_page(page, tmp_path)))
    done = subprocess.run(
        [sys.executable, str(RUNNER), "blocks.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("ok\n") == 1
    page.write_text("```python\nx = 1\n\nraise ValueError('here')\n```\n")
    (tmp_path / "blocks.json").write_text(page_script(parse_page(page, tmp_path)))
    done = subprocess.run(
        [sys.executable, str(RUNNER), "blocks.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and f'{page}", line 4' in done.stdout + done.stderr


def test_a_snippet_brings_its_blocks_in_and_a_page_may_continue_another(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "<!-- --8<-- [start:setup] -->\n```python\nx = 20\n```\n<!-- --8<-- [end:setup] -->\n\n```text\nnot run\n```\n"
    )
    (tmp_path / "docs" / "first.md").write_text('Setup:\n\n--8<-- "README.md:setup"\n')
    later = tmp_path / "docs" / "later.md"
    later.write_text(
        "<!-- docs-test: continues first.md -->\n\n```python\nassert x == 20\nprint('later', x + 1)\n```\n"
    )
    first = parse_page(tmp_path / "docs" / "first.md", tmp_path)
    (block,) = first.blocks
    assert (block.source, block.line, block.code) == (
        tmp_path / "README.md",
        3,
        "x = 20",
    )  # where it is written
    (tmp_path / "blocks.json").write_text(page_script(parse_page(later, tmp_path)))
    done = subprocess.run(
        [sys.executable, str(RUNNER), "blocks.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "later 21" in done.stdout, done.stdout + done.stderr
    (tmp_path / "docs" / "first.md").write_text('--8<-- "README.md:missing"\n')
    with pytest.raises(DocsBlockError, match="no section 'missing'"):
        parse_page(tmp_path / "docs" / "first.md", tmp_path)

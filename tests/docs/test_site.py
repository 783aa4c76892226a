"""The documentation site builds with no warning (broken links and anchors, API pages
that do not resolve), and its generated files match the code that makes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict(tmp_path):
    # (python -m: the `mkdocs` script's own directory holds a file named fluidps, the
    # command, which griffe would take for the package)
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    built = tmp_path / "site"
    assert (built / "guides" / "inspect" / "index.html").exists()
    assert (built / "assets" / "quickstart-pserver0.svg").exists()
    # The API reference is made from the docstrings.
    executors = (built / "reference" / "executors" / "index.html").read_text()
    assert "RemoteExecutor" in executors and "run_batches" in executors


def test_the_drawings_and_the_command_line_page_are_those_the_code_makes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "docs_assets.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr

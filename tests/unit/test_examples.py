"""The examples run end to end as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import fluidps

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def fluidps_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The directory examples/quickstart.py wrote into, and its run."""
    out = tmp_path_factory.mktemp("quickstart")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return out, result


def test_quickstart_writes_programs_that_inspect_cleanly(quickstart):
    out, result = quickstart
    assert "built 30 ops, 6 parameters (85,002 values)" in result.stdout
    main = fluidps.Program.parse_from_string((out / "main.pb").read_bytes())
    fluidps.verify(main)
    inspect = fluidps_cli("inspect", str(out / "main.pb"), "--check")
    assert inspect.returncode == 0 and "verify: ok" in inspect.stdout


def _guide_session(command: str) -> list[str]:
    """The lines docs/guides/inspect.md shows after `$ COMMAND`, up to the next command or
    the block's end."""
    lines = (ROOT / "docs" / "guides" / "inspect.md").read_text().splitlines()
    start = lines.index(f"$ {command}") + 1
    shown = []
    for line in lines[start:]:
        if line.startswith(("$ ", "```")):
            break
        shown.append(line)
    return shown


def test_the_guides_inspect_session_matches_the_cli(quickstart):
    out, _ = quickstart
    main = fluidps.Program.parse_from_string((out / "main.pb").read_bytes())
    block = main.global_block()
    header = (
        f"program: 1 block, {len(block.ops)} ops, {len(block.vars)} variables, "
        f"{len(main.all_parameters())} parameters"
    )
    shown = _guide_session("fluidps inspect quickstart/main.pb --check")
    assert shown[0] == header
    result = fluidps_cli("inspect", str(out / "main.pb"), "--check")
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    assert printed[0] == header
    # Every line the guide shows (its "..." elisions aside) is printed, up to column widths.
    printed_words = [line.split() for line in printed]
    for line in shown:
        if line.strip() and line.strip() != "...":
            assert line.split() in printed_words, line


def test_the_guides_dot_command_writes_the_graph(quickstart, tmp_path):
    out, _ = quickstart
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin")}  # no Graphviz: the .dot alone
    dot_path = tmp_path / "main.dot"
    result = fluidps_cli("dot", str(out / "main.pb"), "-o", str(dot_path), env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wrote {dot_path}\n" and "install Graphviz" in result.stderr
    text = dot_path.read_text()
    main = fluidps.Program.parse_from_string((out / "main.pb").read_bytes())
    ops = main.global_block().ops
    assert text.startswith("digraph program {") and text.count('" [shape=box') == len(ops)
    for i, op in enumerate(ops):
        assert f'"op:0:{i}" [shape=box' in text and f'label="{op.type}"' in text
    for param in main.all_parameters():
        assert f'"var:0:{param.name}" [shape=ellipse, style="filled,bold"' in text

"""The README's quick start runs as printed, and trains as it says: locally, as a job
with one line changed, and reading a dataset (docs/guides/datasets.md)."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
DATASETS_GUIDE = README.parent / "docs" / "guides" / "datasets.md"
QUICK_START = re.compile(r"## Quick start\n\n(?:<!--.*?-->\n)?```python\n(.*?)```", re.S)


def test_quick_start_trains_as_the_readme_says():
    block = QUICK_START.search(README.read_text()).group(1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md", "exec"), {})
    accuracy = float(out.getvalue().split()[-1])
    assert accuracy >= 0.95


def test_the_quick_start_goes_distributed_by_changing_one_line():
    text = README.read_text()
    quick_start = QUICK_START.search(text).group(1)
    section = text[text.index("## Quick start") :]
    line = re.search(r"```python\n(exe = fluidps\.RemoteExecutor\(.*?\))\s+#", section).group(1)
    assert quick_start.count("exe = fluidps.Executor()") == 1
    distributed = quick_start.replace("exe = fluidps.Executor()", line)
    out, namespace = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        exec(compile(distributed, "README.md", "exec"), namespace)
    accuracy = float(out.getvalue().split()[-1])
    assert accuracy >= 0.95
    # The script never closes its executor: dropping it ends the job and its processes.
    pids = namespace["exe"].server_pids
    assert len(pids) == 4
    namespace.clear()
    gc.collect()
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_the_quick_start_reads_a_dataset_as_the_readme_says(tmp_path, monkeypatch):
    text = README.read_text()
    quick_start = QUICK_START.search(text).group(1)
    reading = re.search(r"```python\n(.*?)```", DATASETS_GUIDE.read_text(), re.S).group(1)
    monkeypatch.chdir(tmp_path)  # the snippet writes digits_data/ where it runs
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(quick_start + reading, "README.md", "exec"), {})
    accuracies = [float(line.split()[-1]) for line in out.getvalue().splitlines()]
    assert len(accuracies) == 2 and accuracies[1] >= 0.95  # the quick start's, then the reader's
    assert sorted(p.name for p in (tmp_path / "digits_data").iterdir())[-1] == "part-00006.npz"

"""The layering the packages declare, held with `ast`, as an import-linter contract would.

Every package's `__init__` docstring (or a top-level module's own docstring) has a line

    May import: fluidps.errors, fluidps.ir, fluidps.executor.transport

naming what its modules may import from fluidps besides each other ("anything" for the
command line and the public API, "nothing" for a leaf). A sub-package with its own
declaration is a room of its own: its parent's modules may import it only if their
declaration names it. An entry naming a module or package allows it and what it holds,
up to the next room. Imports under `if TYPE_CHECKING:` are annotations, not
dependencies, and are not checked; imports inside functions are.
"""

from __future__ import annotations

import ast
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import python_output

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "fluidps"
OUTSIDE_THE_PACKAGE = ("tests", "bench", "examples", ".venv", "build")
DECLARATION = re.compile(r"^May import:\s*(.+?)(?:\n\s*\n|\Z)", re.M | re.S)


@dataclass(frozen=True)
class Rule:
    owner: str  # the module or package whose docstring declares it
    allowed: tuple[str, ...]
    anything: bool = False


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def package_files(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (generated protobuf modules excluded)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).parts
        if relative[0] in OUTSIDE_THE_PACKAGE or path.name.endswith("_pb2.py"):
            continue
        files[module_name(path, root)] = path
    return files


def declared_rules(files: dict[str, Path]) -> dict[str, Rule]:
    rules = {}
    for name, path in files.items():
        docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
        match = DECLARATION.search(docstring)
        if match is None:
            continue
        entries = tuple(e.strip().rstrip(".") for e in match.group(1).replace("\n", " ").split(","))
        if entries in (("anything",), ("nothing",)):
            rules[name] = Rule(name, (), anything=entries == ("anything",))
        else:
            rules[name] = Rule(name, entries)
    return rules


def governing(name: str, rules: dict[str, Rule]) -> Rule | None:
    """The rule of the nearest declaring module or package enclosing `name`."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        rule = rules.get(".".join(parts[:i]))
        if rule is not None:
            return rule
    return None


def imports(path: Path, name: str, files: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported fluidps module) of every import that is not for type checking only."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                package = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.append((node.lineno, target if target in files else base))
    return [(line, target) for line, target in found if target == PACKAGE or target.startswith(PACKAGE + ".")]


def allows(rule: Rule, target: str, rules: dict[str, Rule]) -> bool:
    if rule.anything:
        return True
    target_rule = governing(target, rules)
    if target_rule is not None and target_rule.owner == rule.owner:
        return True  # its own room
    for entry in rule.allowed:
        inside = target == entry or target.startswith(entry + ".")
        if inside and governing(entry, rules) == target_rule:
            return True
    return False


def violations(root: Path) -> list[str]:
    files = package_files(root)
    rules = declared_rules(files)
    problems = []
    for name, path in files.items():
        rule = governing(name, rules)
        where = path.relative_to(root)
        if rule is None:
            problems.append(f"{where}: no 'May import:' declaration covers it")
            continue
        for line, target in imports(path, name, files):
            if not allows(rule, target, rules):
                problems.append(
                    f"{where}:{line} imports {target}, which {rule.owner}'s declaration does not allow "
                    f"(May import: {', '.join(rule.allowed) or 'nothing'})"
                )
        for entry in rule.allowed:
            if not any(f == entry or f.startswith(entry + ".") for f in files):
                problems.append(f"{where}: its declaration names {entry}, which is not a fluidps module")
    return problems


def test_every_import_keeps_to_the_declared_layering():
    problems = violations(ROOT)
    assert not problems, "\n".join(problems)


ROOMS = ("compiler", "launch", "measure", "metrics", "pipeline", "ps", "remote", "tasks", "transport")


def test_every_room_of_the_executor_declares_its_imports():
    rules = declared_rules(package_files(ROOT))
    rooms = [p.name for p in (ROOT / "executor").iterdir() if (p / "__init__.py").is_file()]
    assert sorted(rooms) == list(ROOMS)
    for room in ["", *rooms]:
        assert f"fluidps.executor{'.' + room if room else ''}" in rules


def test_a_forbidden_import_fails_naming_the_file_and_line(tmp_path):
    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))

    write("__init__.py", '"""The package.\n\nMay import: anything\n"""\n')
    write("errors.py", '"""Errors.\n\nMay import: nothing\n"""\n')
    write("low/__init__.py", '"""Low.\n\nMay import: fluidps.errors\n"""\n')
    write("low/a.py", "from fluidps.errors import Error\nfrom fluidps.low import b\n")
    write("low/b.py", "")
    write("high/__init__.py", '"""High.\n\nMay import: fluidps.low\n"""\n')
    write("high/room/__init__.py", '"""A room.\n\nMay import: fluidps.low.a\n"""\n')
    write(
        "high/c.py",
        """\
        from typing import TYPE_CHECKING

        from fluidps.low.a import Error

        if TYPE_CHECKING:
            from fluidps.high.room import x  # annotations only


        def late():
            from fluidps.high.room import y  # a room of its own: not allowed
        """,
    )
    write("high/room/d.py", "import fluidps.low.b\n")
    assert violations(tmp_path) == [
        "high/c.py:10 imports fluidps.high.room, which fluidps.high's declaration does not allow "
        "(May import: fluidps.low)",
        "high/room/d.py:1 imports fluidps.low.b, which fluidps.high.room's declaration does not allow "
        "(May import: fluidps.low.a)",
    ]


LOCAL_TRAINING = """
import sys

import numpy as np

import fluidps
from fluidps import layers

main, startup = fluidps.Program(), fluidps.Program()
with fluidps.program_guard(main, startup):
    x = layers.data("x", [4])
    y = layers.data("y", [1], dtype="int64")
    loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(x, 3), y))
    fluidps.optimizer.Adam(0.01).minimize(loss)
exe = fluidps.Executor()
exe.run(startup)
rng = np.random.default_rng(0)
feed = {"x": rng.normal(size=(8, 4)).astype("float32"), "y": rng.integers(0, 3, (8, 1)).astype("int64")}
first = exe.run(main, feed=feed, fetch_list=[loss])[0]
for _ in range(20):
    last = exe.run(main, feed=feed, fetch_list=[loss])[0]
assert last < first, (first, last)
exe.close()
loaded = sorted(m for m in sys.modules if m == "zmq" or m.startswith(("zmq.", "fluidps.executor.")))
print(" ".join(loaded))
"""


@pytest.mark.parametrize("compile_", ["1", "0"], ids=["compiled", "interpreted"])
def test_local_training_loads_no_zeromq_and_no_distributed_room(compile_, tmp_path):
    # A fresh interpreter: this test process has long imported everything.
    env = dict(os.environ, FLUIDPS_COMPILE=compile_, FLUIDPS_CACHE_DIR=str(tmp_path))
    loaded = python_output(LOCAL_TRAINING, env=env, timeout=300).split()
    assert "zmq" not in loaded
    # The compiler room only where the executor compiles (the default) ...
    assert ("fluidps.executor.compiler.segments" in loaded) == (compile_ == "1")
    # ... and of the others, only the two dataclasses a RuntimeConfig is made of (and their packages).
    rooms = [
        m for m in loaded if m.count(".") >= 2 and m.split(".")[2] in ROOMS and m.split(".")[2] != "compiler"
    ]
    assert rooms == [
        "fluidps.executor.ps",
        "fluidps.executor.ps.checkpointer",
        "fluidps.executor.transport",
        "fluidps.executor.transport.settings",
    ]


@pytest.mark.parametrize("name", ["RemoteExecutor", "JobDesc"])
def test_remote_names_still_come_from_the_top_level(name):
    import fluidps
    from fluidps.executor.remote import remote_executor

    assert getattr(fluidps, name) is getattr(remote_executor, name)
    assert name in fluidps.__all__


def test_every_package_directory_is_in_the_wheel():
    """pyproject lists the packages explicitly (the repository root is the package): a
    directory left out would be missing from a wheel, though an editable install finds it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        "fluidps" + "".join("." + part for part in path.parent.relative_to(ROOT).parts)
        for path in ROOT.rglob("__init__.py")
        if not path.relative_to(ROOT).parts[0].startswith((".", "tests", "bench"))
    }
    assert found == listed

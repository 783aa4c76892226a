"""Makes the docs' generated files from the code, so that no picture is drawn by hand.

    python scripts/docs_assets.py          # rewrite them (SVGs need Graphviz's `dot`)
    python scripts/docs_assets.py --check  # exit 1 naming each file that is out of date

- docs/assets/quickstart-*.dot / .svg: `fluidps dot` of the quick start's program
  (examples/quickstart.py) and of its trainer and pserver 0 programs (`fluidps
  transpile`, 2 pservers, 2 trainers), and quickstart-placed, its program with each op in
  the colour of the pserver that runs it; pipeline-main.dot / .svg: of the digits
  pipeline's program (examples/digits_pipeline.py), each op in its stage's colour;
- docs/assets/architecture.svg and step.svg from their DOT sources, which are kept by hand;
- docs/reference/cli.md: every command's `--help`;
- docs/assets/may-import.md.txt: each package's `May import:` line, as a table (the
  architecture page includes it).

Each SVG ends with a comment holding the sha256 of the DOT text it was drawn from, which
`--check` compares (Graphviz's own output differs between its versions; the DOT does not).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "docs" / "assets"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"
MAY_IMPORT = ASSETS / "may-import.md.txt"
_DECLARATION = re.compile(r"^May import:\s*(.+?)(?:\n\s*\n|\Z)", re.M | re.S)
STAMP = "<!-- drawn from DOT sha256 {} -->\n"
COMMANDS = [
    [],
    ["inspect"],
    ["dot"],
    ["transpile"],
    ["place"],
    ["calibrate"],
    ["launch"],
    ["serve"],
    ["data"],
    ["data", "split"],
    ["data", "info"],
    ["stream"],
    ["stream", "append"],
    ["stream", "tail"],
    ["stream", "info"],
    ["checkpoint"],
    ["checkpoint", "list"],
    ["checkpoint", "merge"],
    ["keys", "gen"],
    ["secret", "gen"],
    ["k8s"],
    ["k8s", "render"],
    ["k8s", "submit"],
    ["k8s", "status"],
    ["k8s", "logs"],
    ["k8s", "delete"],
]


def _fluidps(*args: str, cwd: Path) -> str:
    env = dict(os.environ, COLUMNS="100")  # click wraps help text to the terminal's width
    done = subprocess.run(
        [sys.executable, "-m", "fluidps", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"fluidps {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def program_drawings(work: Path) -> dict[str, str]:
    """The DOT text of each drawing, by its asset name."""
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--out", "quickstart"],
        cwd=work,
        check=True,
        capture_output=True,
    )
    _fluidps("dot", "quickstart/main.pb", "-o", "main.dot", cwd=work)
    _fluidps(
        "transpile", "quickstart/main.pb", "--startup", "quickstart/startup.pb",
        "--pservers", "127.0.0.1:6174,127.0.0.1:6175", "--trainers", "2", "-o", "job",
        cwd=work,
    )  # fmt: skip
    _fluidps(
        "dot", "quickstart/main.pb", "--startup", "quickstart/startup.pb",
        "--pservers", "127.0.0.1:6174,127.0.0.1:6175", "-o", "placed.dot",
        cwd=work,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_pipeline.py"), "--epochs", "0", "--out", "pipeline"],
        cwd=work,
        check=True,
        capture_output=True,
    )
    _fluidps("dot", "pipeline/main.pb", "-o", "pipeline.dot", cwd=work)
    return {
        "pipeline-main": (work / "pipeline.dot").read_text(),
        "quickstart-main": (work / "main.dot").read_text(),
        "quickstart-placed": (work / "placed.dot").read_text(),
        "quickstart-trainer": (work / "job" / "trainer.dot").read_text(),
        "quickstart-pserver0": (work / "job" / "pserver_0.dot").read_text(),
    }


def cli_page(work: Path) -> str:
    parts = [
        "# Command line\n",
        "Every command's `--help`, as `fluidps` prints it (made by `scripts/docs_assets.py`).\n",
    ]
    for command in COMMANDS:
        name = " ".join(["fluidps", *command])
        parts.append(f"## `{name}`\n\n```text\n{_fluidps(*command, '--help', cwd=work).rstrip()}\n```\n")
    return "\n".join(parts)


def may_import_table() -> str:
    """Each package (a directory with an __init__.py) and what its docstring lets it import."""
    rows = ["| package | may import |", "|---|---|"]
    for init in sorted(ROOT.rglob("__init__.py"), key=lambda p: p.parent.parts):
        package = init.parent.relative_to(ROOT)
        if package.parts and package.parts[0] in {"tests", "bench", "examples", "scripts", "docs", "build"}:
            continue
        found = _DECLARATION.search(init.read_text())
        if found is None:
            continue
        name = ".".join(("fluidps", *package.parts))
        allowed = " ".join(found.group(1).split()).removesuffix('"""').strip()
        rows.append(f"| `{name}` | {allowed} |")
    return "\n".join(rows) + "\n"


def _digest(dot: str) -> str:
    return hashlib.sha256(dot.encode()).hexdigest()


def expected(work: Path) -> dict[Path, str]:
    """Every generated text file and what it must hold."""
    files = {ASSETS / f"{name}.dot": dot for name, dot in program_drawings(work).items()}
    files[CLI_PAGE] = cli_page(work)
    files[MAY_IMPORT] = may_import_table()
    return files


def stale(files: dict[Path, str]) -> list[str]:
    """What is out of date: a text file that differs, an SVG drawn from other DOT text."""
    problems = [
        str(p.relative_to(ROOT)) for p, text in files.items() if not p.exists() or p.read_text() != text
    ]
    for dot in _drawings(files):
        source = files.get(dot) or dot.read_text()
        svg = dot.with_suffix(".svg")
        if not svg.exists() or not svg.read_text().endswith(STAMP.format(_digest(source))):
            problems.append(str(svg.relative_to(ROOT)))
    return problems


def _drawings(files: dict[Path, str]) -> list[Path]:
    """Every DOT file to draw: the generated ones and those kept by hand in docs/assets."""
    generated = [p for p in files if p.suffix == ".dot"]
    return generated + sorted(p for p in ASSETS.glob("*.dot") if p not in files)


def write(files: dict[Path, str]) -> None:
    if shutil.which("dot") is None:
        raise SystemExit("Graphviz's `dot` is not installed (apt-get install graphviz): it draws the SVGs")
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for dot in _drawings(files):
        svg = subprocess.run(["dot", "-Tsvg", str(dot)], check=True, capture_output=True, text=True).stdout
        dot.with_suffix(".svg").write_text(svg + STAMP.format(_digest(dot.read_text())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="name what is out of date instead of writing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fluidps-docs-") as work:
        files = expected(Path(work))
    if args.check:
        problems = stale(files)
        for problem in problems:
            print(f"out of date: {problem} (python scripts/docs_assets.py rewrites it)")
        return 1 if problems else 0
    write(files)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`fluidps inspect` and `fluidps dot`: look at a program file."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import click

from fluidps.cli.common import CHECK_FAILED, fail, load_program
from fluidps.errors import Error
from fluidps.executor.compiler import explain
from fluidps.ir.graph import OpGroups, to_dot
from fluidps.ir.printer import program_to_dict, program_to_text
from fluidps.ir.program import Program
from fluidps.ops import check
from fluidps.transpiler.analysis import analyze
from fluidps.transpiler.config import SPLIT_METHODS, DistributeTranspilerConfig
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.plan import DistributedPlan

GRAPHVIZ_HINT = (
    "install Graphviz to render it (Debian/Ubuntu: apt install graphviz; macOS: brew install graphviz; "
    "conda: conda install graphviz)"
)


@click.command()
@click.argument("file")
@click.option(
    "--check", "run_check", is_flag=True, help="Verify the program against fluidps's op definitions."
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON instead of text.")
@click.option("--block", "block_idx", type=int, default=None, help="Show only this block.")
@click.option(
    "--plan",
    "show_plan",
    is_flag=True,
    help="Also say which ops an Executor(compile=True) runs as compiled segments, and why the others not.",
)
def inspect(file: str, run_check: bool, as_json: bool, block_idx: int | None, show_plan: bool) -> None:
    """Show the blocks, variables and ops of a ProgramDesc FILE (or saved-model directory)."""
    program = load_program(file)
    if block_idx is not None and not 0 <= block_idx < program.num_blocks:
        fail(f"--block {block_idx}: the program has blocks 0..{program.num_blocks - 1}")
    problems = check(program) if run_check else []
    plan = explain(program.block(block_idx or 0)) if show_plan else None
    if as_json:
        data = program_to_dict(program)
        if block_idx is not None:
            data["blocks"] = [data["blocks"][block_idx]]
        if run_check:
            data["problems"] = problems
        if plan is not None:
            data["plan"] = plan.splitlines()
        click.echo(json.dumps(data, indent=1))
    else:
        click.echo(program_to_text(program, None if block_idx is None else [block_idx]))
        if run_check:
            click.echo("")
            if problems:
                click.echo(f"verify: {len(problems)} problem(s)")
                for p in problems:
                    click.echo(f"  {p}")
            else:
                click.echo("verify: ok")
        if plan is not None:
            click.echo(f"\n{plan}")
    if problems:
        raise SystemExit(CHECK_FAILED)


@click.command()
@click.argument("file")
@click.option(
    "-o", "--output", required=True, help="Where to write: OUT.dot, or OUT.svg / OUT.png to render."
)
@click.option("--block", "block_idx", type=int, default=None, help="Draw only this block.")
@click.option(
    "--pservers",
    help="Comma-separated pserver endpoints: fill each op with the colour of the pserver that would run it.",
)
@click.option("--startup", "startup_file", metavar="STARTUP.pb", help="--pservers: the startup program.")
@click.option(
    "--split-method",
    type=click.Choice(SPLIT_METHODS),
    default="RoundRobin",
    show_default=True,
    help="--pservers: how parameters go to pservers.",
)
def dot(
    file: str,
    output: str,
    block_idx: int | None,
    pservers: str | None,
    startup_file: str | None,
    split_method: str,
) -> None:
    """Draw a ProgramDesc FILE as a Graphviz graph.

    Ops are boxes, variables ellipses (parameters filled, other persistable
    variables doubled), sub-blocks clusters. In a pipeline program each op is
    filled with its stage's colour; with --pservers (and --startup), with the
    colour of the pserver that would run it, as `fluidps transpile` places it.
    A legend names the colours. With OUT.dot, the DOT text is written and, when
    Graphviz's `dot` is installed, OUT.svg next to it.
    """
    program = load_program(file)
    if block_idx is not None and not 0 <= block_idx < program.num_blocks:
        fail(f"--block {block_idx}: the program has blocks 0..{program.num_blocks - 1}")
    out = Path(output)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in ("dot", "gv", "svg", "png"):
        fail(f"{output}: use a .dot, .svg or .png file name")
    groups = None
    if pservers is None and startup_file is not None:
        fail("--startup is for --pservers: give the pservers to place the ops on")
    if pservers is not None:
        if startup_file is None:
            fail("--pservers needs --startup STARTUP.pb: the transpiler places parameters from both programs")
        try:
            config = DistributeTranspilerConfig(split_method=split_method)
            plan = DistributeTranspiler(config).transpile(
                0, program, pservers, startup_program=load_program(startup_file)
            )
            groups = pserver_groups(program, plan)
        except Error as e:
            fail(str(e))
    dot_path = out if fmt in ("dot", "gv") else out.with_suffix(".dot")
    try:
        dot_path.write_text(to_dot(program, block_idx, groups))
    except OSError as e:
        fail(f"cannot write {dot_path}: {e.strerror or e}")
    click.echo(f"wrote {dot_path}")
    dot_binary = shutil.which("dot")
    if fmt in ("dot", "gv"):
        if dot_binary is None:
            click.echo(f"note: {GRAPHVIZ_HINT}", err=True)
            return
        fmt, out = "svg", dot_path.with_suffix(".svg")
    if dot_binary is None:
        fail(f"cannot render {output}: Graphviz's `dot` is not installed; {GRAPHVIZ_HINT}", CHECK_FAILED)
    result = subprocess.run(
        [dot_binary, f"-T{fmt}", str(dot_path), "-o", str(out)], capture_output=True, text=True
    )
    if result.returncode != 0:
        fail(f"dot failed on {dot_path}: {result.stderr.strip()}", CHECK_FAILED)
    click.echo(f"wrote {out}")


def pserver_groups(program: Program, plan: DistributedPlan) -> OpGroups:
    """Block 0's ops of `program` (the one `plan` was transpiled from) by the pserver that
    runs them, for `fluidps dot`: each parameter's optimizer ops go with its pserver
    (group k: endpoint k), or to "several pservers" when it is cut into slices on more
    than one; learning-rate ops run on every pserver; the rest stay on the trainers."""
    roles = analyze(program)
    endpoints = list(plan.endpoints)
    several, every = len(endpoints), len(endpoints) + 1
    of_op: dict[tuple[int, int], int] = {}
    for update in roles.updates:
        held = {endpoints.index(s.endpoint) for s in plan.slices_of(update.param)}
        if held:  # (a parameter no pserver holds stays with the trainers)
            group = held.pop() if len(held) == 1 else several
            of_op.update({(0, i): group for i in update.ops})
    of_op.update({(0, i): every for i in roles.lr_ops})
    names = [f"pserver {k} ({ep})" for k, ep in enumerate(endpoints)] + ["several pservers", "every pserver"]
    return OpGroups(of_op, names, "trainers", "pservers")

"""`fluidps inspect` and `fluidps dot`, through the real command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fluidps
from fluidps import optimizer
from helpers import build_every_layer, build_mlp, paddle_fixture


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120, env=env
    )


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    path = tmp_path / "mlp.pb"
    path.write_bytes(build_mlp()[0].serialize_to_string())
    return path


@pytest.fixture
def pserver_program() -> fluidps.Program:
    """A transpiled pserver program: listen_and_serv in block 0, one optimize sub-block per slice."""
    main, startup, loss = build_mlp()
    with fluidps.program_guard(main, startup):
        optimizer.SGD(0.1).minimize(loss)
    t = fluidps.DistributeTranspiler()
    t.transpile(0, main, "127.0.0.1:6170,127.0.0.1:6171", trainers=2, startup_program=startup)
    program = t.get_pserver_program("127.0.0.1:6170")
    assert program.num_blocks > 2
    return program


@pytest.fixture
def pserver_file(tmp_path: Path, pserver_program) -> Path:
    path = tmp_path / "pserver.pb"
    path.write_bytes(pserver_program.serialize_to_string())
    return path


def test_inspect_shows_blocks_vars_and_ops(mlp_file):
    result = run("inspect", str(mlp_file), "--check")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("program: 1 block, 10 ops, 19 variables, 6 parameters")
    assert "fc_0.w_0" in out and "[64, 32]" in out and "parameter" in out
    assert "#0  mul  [forward]" in out and "in:    X=x  Y=fc_0.w_0" in out
    assert out.rstrip().endswith("verify: ok")


def test_inspect_plan_shows_the_compiled_segments(tmp_path):
    main, startup, loss = build_mlp()
    with fluidps.program_guard(main, startup):
        optimizer.SGD(0.1).minimize(loss)
    path = tmp_path / "train.pb"
    path.write_bytes(main.serialize_to_string())
    result = run("inspect", str(path), "--plan")
    assert result.returncode == 0, result.stderr
    plan = result.stdout[result.stdout.index("\nblock 0: ") + 1 :]
    assert plan.startswith(f"block 0: {len(main.global_block().ops)} ops, ")
    assert "one compiled call (mul, [elementwise_add+" in plan and "one compiled call ({sgd x" in plan
    assert "ops fused into" in plan
    data = json.loads(run("inspect", str(path), "--plan", "--json").stdout)
    assert data["plan"] == plan.strip().splitlines()


def test_inspect_json_is_complete(mlp_file):
    result = run("inspect", str(mlp_file), "--json", "--check")
    data = json.loads(result.stdout)
    assert data["problems"] == []
    ops = data["blocks"][0]["ops"]
    assert ops[0]["type"] == "mul" and ops[0]["attrs"]["x_num_col_dims"] == {"type": "INT", "value": 1}
    var = next(v for v in data["blocks"][0]["vars"] if v["name"] == "fc_0.w_0")
    assert var == {
        "name": "fc_0.w_0",
        "type": "LOD_TENSOR",
        "dtype": "FP32",
        "shape": [64, 32],
        "lod_level": 0,
        "persistable": True,
        "parameter": True,
        "stop_gradient": False,
        "need_check_feed": False,
    }


def test_inspect_paddle_models_cleanly():
    result = run("inspect", str(paddle_fixture("lenet_infer")), "--check")
    assert result.returncode == 0, result.stderr
    assert "(written by Paddle 3.3.1)" in result.stdout
    assert "feed_minibatch" in result.stdout
    training = run("inspect", str(paddle_fixture("adam_sparse") / "main.pb"), "--check")
    assert training.returncode == 0
    assert "[backward|loss]" in training.stdout and "[optimize]" in training.stdout
    assert "op_role_var=[fc_0.w_0, fc_0.w_0@GRAD]" in training.stdout


def test_inspect_check_reports_problems_with_status_1(tmp_path):
    main, _ = build_every_layer()
    main.global_block().ops[0].set_input("Filter", ["missing_filter"])
    path = tmp_path / "broken.pb"
    path.write_bytes(main.serialize_to_string())
    result = run("inspect", str(path), "--check")
    assert result.returncode == 1
    assert "verify: 1 problem(s)" in result.stdout
    assert "block 0, op #0 (conv2d): input Filter reads 'missing_filter'" in result.stdout


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01\x02garbage\xff\xfe", "is not a valid ProgramDesc"),
        (b"", "is not a valid ProgramDesc"),
        (b'{"json": "not a program"}', "is not a valid ProgramDesc"),
        (None, "truncated"),
    ],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, content, message):
    path = tmp_path / "bad.pb"
    if content is None:
        data = build_mlp()[0].serialize_to_string()
        path.write_bytes(data[: len(data) - 7])
        message = "is not a valid ProgramDesc"
    else:
        path.write_bytes(content)
    for command in (["inspect", str(path)], ["dot", str(path), "-o", str(tmp_path / "g.dot")]):
        result = run(*command)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        assert result.stderr.startswith("fluidps: error: ") and message in result.stderr


def test_missing_file_and_empty_directory(tmp_path):
    result = run("inspect", str(tmp_path / "nope.pb"))
    assert result.returncode == 2 and "cannot read" in result.stderr and result.stderr.count("\n") == 1
    result = run("inspect", str(tmp_path))
    assert result.returncode == 2 and "directory without a program file" in result.stderr
    result = run("inspect", str(paddle_fixture("lenet_infer")), "--block", "3")
    assert result.returncode == 2 and "the program has blocks 0..0" in result.stderr


def test_dot_writes_graphviz(tmp_path, mlp_file):
    out = tmp_path / "mlp.dot"
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin")}  # no Graphviz on this PATH
    result = run("dot", str(mlp_file), "-o", str(out), env=env)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert text.startswith("digraph program {") and "cluster_0" in text
    assert '"op:0:0" [shape=box' in text and 'label="mul"' in text
    assert 'fillcolor="#cfe2f3", label="fc_0.w_0\\n[64, 32] float32"' in text
    assert '"var:0:x" -> "op:0:0" [label="X"]' in text
    assert "install Graphviz" in result.stderr
    refused = run("dot", str(mlp_file), "-o", str(tmp_path / "mlp.svg"), env=env)
    assert refused.returncode == 1 and "Graphviz's `dot` is not installed" in refused.stderr
    assert refused.stderr.count("\n") == 1


def test_inspect_one_block_of_a_program_with_sub_blocks(pserver_file, pserver_program):
    n = pserver_program.num_blocks
    full = run("inspect", str(pserver_file))
    assert full.returncode == 0, full.stderr
    headers = [line for line in full.stdout.splitlines() if line.startswith("block ")]
    assert [h.split()[1] for h in headers] == [str(i) for i in range(n)]
    result = run("inspect", str(pserver_file), "--block", "0", "--check")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith(f"program: {n} blocks, ")  # the summary still counts the whole program
    assert [line for line in out.splitlines() if line.startswith("block ")] == [headers[0]]
    assert headers[0].startswith("block 0 (parent: none)")
    assert "#0  listen_and_serv  [rpc]" in out and "pserver_id=0" in out
    assert "endpoint='127.0.0.1:6170'" in out and "gradient -> optimize block:" in out
    assert "  sgd  [optimize]" not in out  # the optimizer ops live in the sub-blocks
    assert out.rstrip().endswith("verify: ok")
    last = run("inspect", str(pserver_file), "--block", str(n - 1))
    assert last.returncode == 0, last.stderr
    assert [line for line in last.stdout.splitlines() if line.startswith("block ")] == [headers[-1]]
    assert "optimize block of" in headers[-1] and "  sgd  [optimize]" in last.stdout
    assert "listen_and_serv" not in last.stdout
    as_json = json.loads(run("inspect", str(pserver_file), "--block", "0", "--json").stdout)
    assert len(as_json["blocks"]) == 1 and [op["type"] for op in as_json["blocks"][0]["ops"]] == [
        "listen_and_serv"
    ]


def test_dot_draws_one_block(tmp_path, pserver_file, pserver_program):
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin")}
    whole = tmp_path / "whole.dot"
    assert run("dot", str(pserver_file), "-o", str(whole), env=env).returncode == 0
    whole_text = whole.read_text()
    for i in range(pserver_program.num_blocks):
        assert f"subgraph cluster_{i} {{" in whole_text
    idx = pserver_program.num_blocks - 1
    out = tmp_path / "block.dot"
    result = run("dot", str(pserver_file), "-o", str(out), "--block", str(idx), env=env)
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    text = out.read_text()
    assert text.startswith("digraph program {") and text.rstrip().endswith("}")
    assert f'label="block {idx} (parent 0)"' in text
    ops = pserver_program.block(idx).ops
    for i, op in enumerate(ops):
        assert f'"op:{idx}:{i}" [shape=box' in text and f'label="{op.type}"' in text
    assert text.count('" [shape=box') == len(ops)  # only this block's ops
    assert '"op:0:0"' not in text and "listen_and_serv" not in text
    other = next(i for i in range(1, pserver_program.num_blocks) if i != idx)
    assert f"cluster_{other} " not in text and f'"op:{other}:' not in text
    # Block 0's variables the sub-block reads and writes are drawn, in block 0's cluster.
    param = ops[-1].input("Param")[0]
    assert f'"var:0:{param}" -> "op:{idx}:{len(ops) - 1}" [label="Param"]' in text
    bad = run("dot", str(pserver_file), "-o", str(tmp_path / "x.dot"), "--block", str(idx + 1))
    assert bad.returncode == 2 and f"the program has blocks 0..{idx}" in bad.stderr


FAKE_DOT = """#!/bin/sh
# A stand-in for Graphviz's dot: record the arguments, write a file where -o says.
printf '%s\\n' "$@" > "${0%/*}/argv.txt"  # only this script is on PATH: shell built-ins only
[ -n "$FAKE_DOT_FAIL" ] && { echo "syntax error in line 1" >&2; exit 1; }
out=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then out="$2"; fi
    shift
done
printf 'rendered by fake dot\\n' > "$out"
"""


@pytest.fixture
def fake_dot(tmp_path: Path) -> tuple[Path, dict]:
    """A `dot` on PATH that records its argv in BIN/argv.txt; (BIN, env for the CLI)."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    script = bin_dir / "dot"
    script.write_text(FAKE_DOT)
    script.chmod(0o755)
    return bin_dir, {**os.environ, "PATH": str(bin_dir)}


@pytest.mark.parametrize(("suffix", "rendered"), [("dot", "svg"), ("svg", "svg"), ("png", "png")])
def test_dot_renders_through_graphviz_on_path(tmp_path, mlp_file, fake_dot, suffix, rendered):
    bin_dir, env = fake_dot
    out = tmp_path / f"mlp.{suffix}"
    result = run("dot", str(mlp_file), "-o", str(out), env=env)
    assert result.returncode == 0, result.stderr
    dot_path, image = tmp_path / "mlp.dot", tmp_path / f"mlp.{rendered}"
    assert (bin_dir / "argv.txt").read_text().splitlines() == [
        f"-T{rendered}",
        str(dot_path),
        "-o",
        str(image),
    ]
    assert dot_path.read_text().startswith("digraph program {")  # what dot was given to render
    assert image.read_text() == "rendered by fake dot\n"
    assert result.stdout.splitlines() == [f"wrote {dot_path}", f"wrote {image}"]
    assert "install Graphviz" not in result.stderr


def test_dot_failure_of_graphviz_is_one_line_and_status_1(tmp_path, mlp_file, fake_dot):
    _, env = fake_dot
    result = run("dot", str(mlp_file), "-o", str(tmp_path / "mlp.svg"), env={**env, "FAKE_DOT_FAIL": "1"})
    assert result.returncode == 1
    assert result.stderr == f"fluidps: error: dot failed on {tmp_path / 'mlp.dot'}: syntax error in line 1\n"
    assert not (tmp_path / "mlp.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz is not installed")
def test_dot_renders_svg_and_png_with_graphviz(tmp_path, mlp_file):
    result = run("dot", str(mlp_file), "-o", str(tmp_path / "mlp.dot"))
    assert result.returncode == 0
    assert (tmp_path / "mlp.svg").read_text().lstrip().startswith("<?xml")
    result = run("dot", str(paddle_fixture("lenet_infer")), "-o", str(tmp_path / "lenet.png"))
    assert result.returncode == 0
    assert (tmp_path / "lenet.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_help_and_version():
    result = run("--help")
    assert result.returncode == 0 and "inspect" in result.stdout and "dot" in result.stdout
    assert run("--version").stdout.startswith("fluidps, version")


def test_dot_with_pservers_fills_each_op_with_the_colour_of_the_pserver_that_runs_it(tmp_path):
    from fluidps.ir.graph import STAGE_COLOURS

    main, startup, loss = build_mlp(hidden=1024)  # fc_1.w_0 (1024 x 1024) is cut into slices
    with fluidps.program_guard(main, startup):
        lr = fluidps.layers.exponential_decay(0.1, decay_steps=10, decay_rate=0.9)
        optimizer.SGD(lr).minimize(loss)
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    eps = "127.0.0.1:6170,127.0.0.1:6171"
    env = {**os.environ, "PATH": str(tmp_path / "empty-bin")}
    out = tmp_path / "placed.dot"
    args = ("dot", str(tmp_path / "main.pb"), "-o", str(out), "--pservers", eps)
    result = run(*args, "--startup", str(tmp_path / "startup.pb"), env=env)
    assert result.returncode == 0, result.stderr
    text = out.read_text()

    plan = fluidps.DistributeTranspiler().transpile(0, main, eps, startup_program=startup)
    ops = main.global_block().ops
    for i, op in enumerate(ops):
        fill = next(line for line in text.splitlines() if line.strip().startswith(f'"op:0:{i}" ['))
        if op.type == "sgd":
            held = {s.endpoint for s in plan.slices_of(op.input("Param")[0])}
            group = plan.endpoints.index(held.pop()) if len(held) == 1 else 2
            assert f'fillcolor="{STAGE_COLOURS[group]}"' in fill, (op.input("Param"), fill)
        elif op.type == "mul":
            assert 'fillcolor="#fff2cc"' in fill  # the trainers' ops keep the plain fill
    assert any(len({s.endpoint for s in plan.slices_of(p)}) == 2 for p in ("fc_1.w_0",))
    for label in ("pserver 0 (127.0.0.1:6170)", "pserver 1 (127.0.0.1:6171)", "several pservers",
                  "every pserver", "trainers"):  # fmt: skip
        assert f'label="{label}"' in text, label
    assert 'label="pservers"' in text

    refused = run(*args, env=env)
    assert refused.returncode == 2 and "--pservers needs --startup STARTUP.pb" in refused.stderr

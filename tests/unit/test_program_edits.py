"""Editing a program after running it: every mutation path bumps `Program.revision`,
so the executor never runs a stale prepared program."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.ir.tracked import TrackedDict, TrackedList
from fluidps.ir.types import VarType

X = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.5]], np.float32)


def _scale_program() -> tuple[fluidps.Program, fluidps.Variable]:
    """y = scale(x, 2), built through the builder API."""
    main = fluidps.Program()
    with fluidps.program_guard(main):
        x = layers.data("x", [3])
        y = layers.scale(x, 2.0)
    return main, y


def _run(exe: fluidps.Executor, main: fluidps.Program, y: fluidps.Variable) -> np.ndarray:
    (out,) = exe.run(main, feed={"x": X}, fetch_list=[y])
    return out


def _scale_op(block: fluidps.Block, x: str, out: str, scale: float) -> fluidps.Operator:
    """A scale op not yet in `block.ops`, for the edits that put ops in the list by hand."""
    return fluidps.Operator(block, "scale", {"X": [x]}, {"Out": [out]}, {"scale": scale, "bias": 0.0})


# -- the executor sees every edit ---------------------------------------------------------
# Each edit takes (main, y) and returns the factor y = factor * x has after it.


def _set_attr(main, y):
    main.global_block().ops[0].set_attr("scale", 3.0)
    return 3.0


def _ops_append(main, y):
    block = main.global_block()
    block.ops.append(_scale_op(block, y.name, y.name, 10.0))
    return 20.0


def _ops_insert(main, y):
    block = main.global_block()
    block.ops.insert(1, _scale_op(block, y.name, y.name, -1.0))
    return -2.0


def _ops_assign(main, y):
    block = main.global_block()
    block.ops = [block.ops[0], _scale_op(block, y.name, y.name, 10.0)]
    return 20.0


def _ops_setitem(main, y):
    block = main.global_block()
    block.ops[0] = _scale_op(block, "x", y.name, 5.0)
    return 5.0


def _op_type(main, y):
    op = main.global_block().ops[0]
    op.type = "assign"
    for name in ("scale", "bias", "bias_after_scale"):  # scale's, which assign does not define
        op.remove_attr(name)
    return 1.0


def _op_set_input(main, y):
    block = main.global_block()
    fluidps.op_registry.append_op(block, "scale", {"X": y}, {"Out": y}, {"scale": 10.0})
    block.ops[1].set_input("X", ["x"])  # y = 10 x, no longer 10 (2 x)
    return 10.0


EDITS = {
    "set_attr": _set_attr,
    "ops.append": _ops_append,
    "ops.insert": _ops_insert,
    "ops = [...]": _ops_assign,
    "ops[i] = op": _ops_setitem,
    "op.type": _op_type,
    "op.set_input": _op_set_input,
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_a_run_after_an_edit_runs_the_edited_program(edit):
    main, y = _scale_program()
    exe = fluidps.Executor()
    np.testing.assert_allclose(_run(exe, main, y), 2 * X)
    factor = edit(main, y)
    np.testing.assert_allclose(_run(exe, main, y), factor * X, rtol=1e-6)


def test_removing_ops_through_the_list():
    main, y = _scale_program()
    block = main.global_block()
    exe = fluidps.Executor()
    fluidps.op_registry.append_op(block, "scale", {"X": y}, {"Out": y}, {"scale": 10.0})
    fluidps.op_registry.append_op(block, "scale", {"X": y}, {"Out": y}, {"scale": -1.0})
    np.testing.assert_allclose(_run(exe, main, y), -20 * X)
    block.ops.pop()
    np.testing.assert_allclose(_run(exe, main, y), 20 * X)
    del block.ops[1]
    np.testing.assert_allclose(_run(exe, main, y), 2 * X)


def test_variable_attribute_edits_reach_the_executor():
    main, y = _scale_program()
    exe = fluidps.Executor()
    _run(exe, main, y)
    assert y.name not in exe.scope  # a temporary: not kept between runs
    y.persistable = True
    _run(exe, main, y)
    np.testing.assert_allclose(exe.scope[y.name], 2 * X)


def test_block_vars_edits_reach_the_executor():
    main, y = _scale_program()
    block = main.global_block()
    exe = fluidps.Executor()
    _run(exe, main, y)
    # Redeclare y as persistable by replacing its entry: its value is now kept.
    block.vars[y.name] = fluidps.Variable(block, y.name, dtype=VarType.FP32, shape=[-1, 3], persistable=True)
    _run(exe, main, y)
    np.testing.assert_allclose(exe.scope[y.name], 2 * X)
    # Without x's declaration the program cannot run, and the executor says so.
    del block.vars["x"]
    with pytest.raises(fluidps.ProgramError, match="reads 'x', which no enclosing block declares"):
        _run(exe, main, y)


def test_running_is_no_edit():
    main, y = _scale_program()
    exe = fluidps.Executor()
    _run(exe, main, y)
    revision = main.revision
    prepared = exe.prepare(main, ["x"], [y.name])
    _run(exe, main, y)
    assert main.revision == revision
    assert exe.prepare(main, ["x"], [y.name]) is prepared


# -- every mutation path bumps the revision ---------------------------------------------


def _program() -> fluidps.Program:
    """y = scale(x) plus a parameter and a sub-block, to give every path something to edit."""
    main, _ = _scale_program()
    main.global_block().create_parameter("w", [3], "float32")
    main.create_block()
    main.rollback()
    return main


def _op(p):
    return p.global_block().ops[0]


def _var(p):
    return p.global_block().var("x")


def _block(p):
    return p.global_block()


MUTATIONS = {
    # Block / Operator methods
    "create_var": lambda p: _block(p).create_var("z", shape=[1], dtype="float32"),
    "remove_var": lambda p: _block(p).remove_var("x"),
    "op_registry.append_op": lambda p: fluidps.op_registry.append_op(
        _block(p), "scale", {"X": "x"}, {"Out": "x"}, index=0
    ),
    "remove_op": lambda p: _block(p).remove_op(0),
    "create_block": lambda p: p.create_block(),
    "set_attr": lambda p: _op(p).set_attr("scale", 4.0),
    "set_input": lambda p: _op(p).set_input("X", ["w"]),
    "set_output": lambda p: _op(p).set_output("Out", ["w"]),
    "rename_input": lambda p: _op(p).rename_input("x", "w"),
    # block.ops, a list
    "ops.append": lambda p: _block(p).ops.append(_op(p)),
    "ops.extend": lambda p: _block(p).ops.extend([_op(p)]),
    "ops.insert": lambda p: _block(p).ops.insert(0, _op(p)),
    "ops.remove": lambda p: _block(p).ops.remove(_op(p)),
    "ops.pop": lambda p: _block(p).ops.pop(),
    "ops.clear": lambda p: _block(p).ops.clear(),
    "ops.sort": lambda p: _block(p).ops.sort(key=id),
    "ops.reverse": lambda p: _block(p).ops.reverse(),
    "ops[i] =": lambda p: _block(p).ops.__setitem__(0, _op(p)),
    "ops[:] =": lambda p: _block(p).ops.__setitem__(slice(None), []),
    "del ops[i]": lambda p: _block(p).ops.__delitem__(0),
    "ops +=": lambda p: _block(p).ops.__iadd__([_op(p)]),
    "ops *=": lambda p: _block(p).ops.__imul__(2),
    "ops = [...]": lambda p: setattr(_block(p), "ops", []),
    # block.vars, a dict
    "vars[k] =": lambda p: _block(p).vars.__setitem__("x2", _var(p)),
    "del vars[k]": lambda p: _block(p).vars.__delitem__("x"),
    "vars.pop": lambda p: _block(p).vars.pop("x"),
    "vars.popitem": lambda p: _block(p).vars.popitem(),
    "vars.clear": lambda p: _block(p).vars.clear(),
    "vars.update": lambda p: _block(p).vars.update(x2=_var(p)),
    "vars.setdefault": lambda p: _block(p).vars.setdefault("x2", _var(p)),
    "vars |=": lambda p: _block(p).vars.__ior__({"x2": _var(p)}),
    "vars = {...}": lambda p: setattr(_block(p), "vars", {}),
    # program.blocks, a list
    "blocks.pop": lambda p: p.blocks.pop(),
    "blocks = [...]": lambda p: setattr(p, "blocks", p.blocks[:1]),
    # attributes
    "var.shape": lambda p: setattr(_var(p), "shape", (-1, 4)),
    "var.dtype": lambda p: setattr(_var(p), "dtype", VarType.FP64),
    "var.persistable": lambda p: setattr(_var(p), "persistable", True),
    "var.type": lambda p: setattr(_var(p), "type", VarType.SELECTED_ROWS),
    "var.lod_level": lambda p: setattr(_var(p), "lod_level", 1),
    "var.stop_gradient": lambda p: setattr(_var(p), "stop_gradient", False),
    "var.need_check_feed": lambda p: setattr(_var(p), "need_check_feed", False),
    "var.name": lambda p: setattr(_var(p), "name", "x2"),
    "parameter.trainable": lambda p: setattr(_block(p).var("w"), "trainable", False),
    "op.type": lambda p: setattr(_op(p), "type", "assign"),
    "op.is_target": lambda p: setattr(_op(p), "is_target", True),
    "block.idx": lambda p: setattr(p.block(1), "idx", 2),
    "block.parent_idx": lambda p: setattr(p.block(1), "parent_idx", -1),
    "block.forward_block_idx": lambda p: setattr(p.block(1), "forward_block_idx", 0),
    "program.random_seed": lambda p: setattr(p, "random_seed", 7),
    "program.format_version": lambda p: setattr(p, "format_version", 2),
}


@pytest.mark.parametrize("mutate", MUTATIONS.values(), ids=MUTATIONS.keys())
def test_every_mutation_path_bumps_the_revision(mutate):
    program = _program()
    before = program.revision
    mutate(program)
    assert program.revision > before


def test_reads_and_copies_are_no_edits():
    program = _program()
    block = program.global_block()
    before = program.revision
    _ = [op.type for op in block.ops], block.ops[0], len(block.ops), list(block.vars.items())
    _ = block.vars.get("x"), "x" in block.vars, block.find_var("w"), program.all_parameters()
    _ = program.serialize_to_string(), str(program)
    ops, variables = block.ops[:], block.vars.copy()
    assert type(ops) is list and type(variables) is dict  # plain copies, detached
    ops.clear()
    variables.clear()
    clone = program.clone()
    assert program.revision == before
    assert clone.revision == 0
    assert fluidps.Program.parse_from_string(program.serialize_to_string()).revision == 0


def test_assigned_containers_are_copied_into_tracked_ones():
    program = _program()
    block = program.global_block()
    ops = list(block.ops)
    block.ops = ops
    assert isinstance(block.ops, TrackedList) and block.ops is not ops
    ops.clear()  # the caller's list is no alias of the block's
    assert len(block.ops) == 1
    block.vars = dict(block.vars)
    assert isinstance(block.vars, TrackedDict)
    program.blocks = list(program.blocks)
    assert isinstance(program.blocks, TrackedList)
    before = program.revision
    block.ops.append(block.ops[0])
    assert program.revision > before


def test_a_mutation_that_fails_part_way_still_counts():
    program = _program()
    block = program.global_block()
    before = program.revision

    def ops_then_error():
        yield block.ops[0]
        raise RuntimeError("iterator failed")

    with pytest.raises(RuntimeError):
        block.ops.extend(ops_then_error())
    assert len(block.ops) == 2 and program.revision > before


def test_a_deep_copy_reports_its_edits_to_itself():
    program = _program()
    twin = copy.deepcopy(program)
    before, twin_before = program.revision, twin.revision
    twin.global_block().ops.pop()
    twin.global_block().var("x").shape = (-1, 4)
    assert program.revision == before and twin.revision > twin_before
    assert len(program.global_block().ops) == 1

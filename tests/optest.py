"""OpTest: check one op's kernels, forward against a numpy reference and gradient
against central finite differences in float64, through the public Executor.

    check_output("relu", {"X": x}, reference=lambda X: {"Out": np.maximum(X, 0)})
    check_grad("relu", {"X": x}, wrt=["X"])

Inputs map a slot to an array (or a list of arrays for duplicable slots).
Float inputs are cast to the dtype under test; integer inputs are left alone.

Every program with an op that has a compiled form (fluidps.ops.lowering) runs under
the compiled executor too (each op a segment; forward and grad ops fused where they
can be), which must give the interpreter's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import fluidps
from fluidps.executor.compiler import Compiler, ModuleCache, default_cache_dir
from fluidps.ir.opschema import GradContext
from fluidps.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, VarType
from fluidps.ops import REGISTRY
from fluidps.ops.selected_rows import SelectedRows

Inputs = Mapping[str, Any]


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _cast(value: Any, dtype: str | None) -> Any:
    if isinstance(value, SelectedRows):
        return SelectedRows(value.rows, _cast(value.value, dtype), value.height) if dtype else value
    array = np.asarray(value)
    if dtype is not None and array.dtype.kind == "f":
        return array.astype(dtype)
    return array


def cast_inputs(inputs: Inputs, dtype: str | None) -> dict[str, Any]:
    out = {}
    for slot, value in inputs.items():
        values = [_cast(v, dtype) for v in _as_list(value)]
        out[slot] = values if isinstance(value, (list, tuple)) else values[0]
    return out


def compiled_agrees(
    program: fluidps.Program, feed: Mapping[str, Any], names: Sequence[str], want: Sequence[Any]
) -> None:
    """The compiled executor's `names` after running `program` on `feed` equal `want`
    (the interpreter's) bit for bit; nothing to check when no op has a compiled form."""
    if not any(REGISTRY.has_lowering(op.type) for op in program.global_block().ops):
        return
    exe = fluidps.Executor(compile=Compiler(ModuleCache(default_cache_dir()), min_ops=1, compile_after=2))
    for _ in range(2):  # a block is compiled at its second run; fresh inputs each time (updates in place)
        got = exe.run(program, feed={k: _copy(v) for k, v in feed.items()}, fetch_list=list(names))
    for name, g, w in zip(names, got, want, strict=True):
        np.testing.assert_array_equal(_dense(g), _dense(w), err_msg=f"{name}: compiled != interpreted")


def _copy(value: Any) -> Any:
    if isinstance(value, SelectedRows):
        return SelectedRows(value.rows.copy(), value.value.copy(), value.height)
    return value.copy() if isinstance(value, np.ndarray) else value


class OpProgram:
    """A program holding one op, its input variables fed by name."""

    def __init__(
        self, op_type: str, inputs: Inputs, attrs: Mapping[str, Any] | None, outputs: Mapping[str, int] | None
    ):
        self.program = fluidps.Program()
        block = self.block = self.program.global_block()
        self.feed: dict[str, Any] = {}
        in_slots: dict[str, list[str]] = {}
        for slot, value in inputs.items():
            names = []
            for i, v in enumerate(_as_list(value)):
                name = f"{slot}_{i}"
                kind = VarType.SELECTED_ROWS if isinstance(v, SelectedRows) else VarType.LOD_TENSOR
                block.create_var(name, shape=v.shape, dtype=v.dtype, type=kind)
                self.feed[name] = v
                names.append(name)
            in_slots[slot] = names
        schema = REGISTRY[op_type]
        counts = {s.name: 1 for s in schema.outputs if not s.dispensable}
        counts.update(outputs or {})
        self.out_slots = {slot: [f"{slot}_out_{i}" for i in range(n)] for slot, n in counts.items()}
        for names in self.out_slots.values():
            for name in names:
                block.create_var(name)
        self.in_slots = in_slots
        self.op = REGISTRY.append_op(block, op_type, in_slots, self.out_slots, attrs)
        self.exe = fluidps.Executor(compile=False)  # the interpreter: the reference

    def run(
        self,
        feed: Mapping[str, Any] | None = None,
        fetch: Sequence[str] | None = None,
        compiled: bool = False,
    ) -> list[Any]:
        """The fetched values; with `compiled`, checked against the compiled executor's."""
        names = list(fetch) if fetch is not None else [n for ns in self.out_slots.values() for n in ns]
        feed = dict(feed or self.feed)
        got = self.exe.run(self.program, feed={k: _copy(v) for k, v in feed.items()}, fetch_list=names)
        if compiled:
            compiled_agrees(self.program, feed, names, got)
        return got

    def outputs(self, feed: Mapping[str, Any] | None = None) -> dict[str, Any]:
        values = iter(self.run(feed, compiled=True))
        return {slot: [next(values) for _ in names] for slot, names in self.out_slots.items()}


def run_op(
    op_type: str,
    inputs: Inputs,
    attrs: Mapping[str, Any] | None = None,
    outputs: Mapping[str, int] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """Run one op through the Executor; returns {output slot: value or list of values}."""
    prog = OpProgram(op_type, cast_inputs(inputs, dtype), attrs, outputs)
    got = prog.outputs()
    return {slot: values if len(values) > 1 else values[0] for slot, values in got.items()}


def _dense(value: Any) -> np.ndarray:
    return value.to_dense() if isinstance(value, SelectedRows) else np.asarray(value)


def check_output(
    op_type: str,
    inputs: Inputs,
    reference: Callable[..., Mapping[str, Any]],
    attrs: Mapping[str, Any] | None = None,
    outputs: Mapping[str, int] | None = None,
    dtypes: Sequence[str] = ("float32", "float64"),
    atol: float | None = None,
    rtol: float | None = None,
) -> None:
    """For each dtype, the op's outputs equal reference(**inputs) (which receives
    the inputs as cast to that dtype and returns {slot: array or list})."""
    for dtype in dtypes:
        cast = cast_inputs(inputs, dtype)
        got = run_op(op_type, cast, attrs, outputs)
        want = reference(**cast)
        tol = (1e-5, 1e-5) if dtype == "float32" else (1e-10, 1e-10)
        for slot, expected in want.items():
            actual = got[slot]
            for a, e in zip(_as_list(actual), _as_list(expected), strict=True):
                e = np.asarray(e)
                a_dense = _dense(a)
                assert a_dense.shape == e.shape, (
                    f"{op_type} {slot} ({dtype}): shape {a_dense.shape} != {e.shape}"
                )
                if e.dtype.kind == "f":
                    assert a_dense.dtype == e.dtype or e.dtype == np.float64, (
                        f"{op_type} {slot}: dtype {a_dense.dtype}"
                    )
                np.testing.assert_allclose(
                    a_dense,
                    e,
                    rtol=rtol if rtol is not None else tol[1],
                    atol=atol if atol is not None else tol[0],
                    err_msg=f"{op_type} output {slot} ({dtype})",
                )


def check_grad(
    op_type: str,
    inputs: Inputs,
    wrt: Sequence[str],
    attrs: Mapping[str, Any] | None = None,
    outputs: Mapping[str, int] | None = None,
    of: Sequence[str] | None = None,
    no_grad: Sequence[str] = (),
    delta: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-7,
    seed: int = 0,
) -> dict[str, list[np.ndarray]]:
    """Analytic gradients (the op's grad maker and grad kernels) of
    L = sum_o sum(out_o * dout_o) with respect to the `wrt` input slots equal
    central finite differences, in float64. `of` picks the outputs in L
    (default: every float output). Returns the analytic gradients."""
    rng = np.random.default_rng(seed)
    cast = cast_inputs(inputs, "float64")
    fwd = OpProgram(op_type, cast, attrs, outputs)
    values = fwd.outputs()
    of = list(of) if of is not None else [s for s, vs in values.items() if _dense(vs[0]).dtype.kind == "f"]
    seeds = {
        name: rng.normal(size=_dense(v).shape).astype(_dense(v).dtype)
        for slot in of
        for name, v in zip(fwd.out_slots[slot], values[slot], strict=True)
    }

    # Analytic: forward op, then the grad ops its grad maker emits, fed the seeds.
    block = fwd.block
    for name, value in seeds.items():
        var = block.var(name)
        block.create_var(name + GRAD_SUFFIX, shape=value.shape, dtype=var.dtype)
    no_grad_names = {n for slot in no_grad for n in fwd.in_slots[slot]}
    no_grad_names |= {n for slot, names in fwd.in_slots.items() if slot not in wrt for n in names}
    for desc in REGISTRY[op_type].grad(GradContext(fwd.op, frozenset(no_grad_names))):
        for names in (*desc.inputs.values(), *desc.outputs.values()):
            for name in names:
                if name.endswith(GRAD_SUFFIX) and name not in block.vars:
                    base = block.var(name[: -len(GRAD_SUFFIX)])
                    block.create_var(name, shape=base.shape, dtype=base.dtype)
        for slot_names in desc.inputs.values():
            for name in slot_names:
                base = name[: -len(GRAD_SUFFIX)]
                if name.endswith(GRAD_SUFFIX) and base not in seeds and name != EMPTY_VAR_NAME:
                    # An output not in L: its gradient is zero.
                    value = _dense(fwd.run(fetch=[base])[0])
                    seeds[base] = np.zeros(value.shape, dtype=value.dtype)
        REGISTRY.append_op(block, desc.type, desc.inputs, desc.outputs, desc.attrs)
    fluidps.verify(fwd.program)
    grad_names = {slot: [n + GRAD_SUFFIX for n in fwd.in_slots[slot]] for slot in wrt}
    feed = dict(fwd.feed)
    feed.update({name + GRAD_SUFFIX: value for name, value in seeds.items()})
    flat_names = [n for slot in wrt for n in grad_names[slot]]
    analytic = dict(zip(flat_names, fwd.run(feed, flat_names, compiled=True), strict=True))

    # Numeric: perturb each input element, re-run the forward op alone.
    numeric_prog = OpProgram(op_type, cast, attrs, outputs)
    out_names = [n for slot in of for n in numeric_prog.out_slots[slot]]

    def loss(feed_values: dict[str, Any]) -> float:
        outs = numeric_prog.run(feed_values, out_names)
        return float(sum(np.sum(_dense(o) * seeds[n]) for o, n in zip(outs, out_names, strict=True)))

    result: dict[str, list[np.ndarray]] = {}
    for slot in wrt:
        result[slot] = []
        for name in numeric_prog.in_slots[slot]:
            base = numeric_prog.feed[name]
            dense_base = base.value if isinstance(base, SelectedRows) else base
            numeric = np.zeros_like(dense_base, dtype=np.float64)
            for idx in np.ndindex(dense_base.shape):
                values_at = {}
                for sign in (1, -1):
                    bumped = dense_base.copy()
                    bumped[idx] += sign * delta
                    feed_values = dict(numeric_prog.feed)
                    feed_values[name] = (
                        SelectedRows(base.rows, bumped, base.height)
                        if isinstance(base, SelectedRows)
                        else bumped
                    )
                    values_at[sign] = loss(feed_values)
                numeric[idx] = (values_at[1] - values_at[-1]) / (2 * delta)
            got = analytic[name + GRAD_SUFFIX]
            got = (
                got.value if isinstance(base, SelectedRows) and isinstance(got, SelectedRows) else _dense(got)
            )
            # A check comparing zeros with zeros would pass without checking anything.
            assert np.any(numeric != 0) or np.any(got != 0), f"{op_type}: d loss / d {slot} is all zero"
            np.testing.assert_allclose(
                got, numeric, rtol=rtol, atol=atol, err_msg=f"{op_type}: d loss / d {slot} ({name})"
            )
            result[slot].append(got)
    return result

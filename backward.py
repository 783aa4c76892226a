"""append_backward: reverse-mode autodiff over a program's global block.

Like the layers, this extends the program being built (Fluid's contract);
the transpiler's passes, by contrast, never touch their input.

The algorithm is Fluid's:
1. find the ops the loss depends on, skipping variables that stop gradients;
2. seed `loss@GRAD` with a fill_constant of 1 (op_role Backward | Loss);
3. walk those ops in reverse, asking each op's grad maker for its grad ops;
4. when a gradient is written more than once (a variable read by several
   ops) rename each write `x@GRAD@RENAME@block0@k` and insert a `sum` before
   the gradient is read;
5. a grad op whose output gradients were never produced is dropped; one
   missing only some gets them from `fill_zeros_like`;
6. append the grad ops (op_role Backward; op_role_var [param, grad] on the
   op that makes a parameter's gradient; the forward op's op_device) and
   return (param, grad) pairs.

May import: fluidps.errors, fluidps.ir, fluidps.ops
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from fluidps.errors import BuilderError
from fluidps.ir.opschema import GradContext, GradOpDesc
from fluidps.ir.program import Block
from fluidps.ir.types import (
    EMPTY_VAR_NAME,
    FLOAT_TYPES,
    GRAD_SUFFIX,
    OP_DEVICE_ATTR,
    OP_ROLE_ATTR,
    OP_ROLE_VAR_ATTR,
    RENAME_SUFFIX,
    OpRole,
    grad_var_name,
)
from fluidps.ir.variable import Parameter, Variable
from fluidps.ops import REGISTRY

_NO_GRAD = frozenset({EMPTY_VAR_NAME})


def append_backward(
    loss: Variable,
    parameter_list: Sequence[Parameter | str] | None = None,
    no_grad_set: Iterable[Variable | str] | None = None,
) -> list[tuple[Parameter, Variable]]:
    """Append the gradient ops of `loss` to its program; return (param, grad)
    for each trainable parameter (or each of `parameter_list`) the loss
    depends on, in the order parameters were created."""
    if not isinstance(loss, Variable):
        raise BuilderError(f"append_backward needs the loss Variable, got {type(loss).__name__}")
    block = loss.block
    if block.idx != 0:
        raise BuilderError(f"append_backward: the loss {loss.name!r} must be in the global block")
    program = block.program
    no_grad = _no_grad_names(block, no_grad_set)
    if loss.name in no_grad:
        raise BuilderError(
            f"append_backward: the loss {loss.name!r} has stop_gradient set; nothing to differentiate"
        )

    path = _op_path(block, loss.name, no_grad)
    if not path:
        raise BuilderError(f"append_backward: no op computes {loss.name!r}")
    loss_op = path[-1]
    loss_op.set_attr(OP_ROLE_ATTR, int(OpRole.Forward | OpRole.Loss))

    descs: list[GradOpDesc] = [
        GradOpDesc(
            "fill_constant",
            {},
            {"Out": [grad_var_name(loss.name)]},
            {"shape": list(loss.shape or ()), "dtype": int(loss.dtype), "value": 1.0},
        )
    ]
    for op in reversed(path):
        maker = REGISTRY.schema(op.type).grad
        if maker is not None:
            made = maker(GradContext(op, frozenset(no_grad)))
            # A grad op runs where its forward op does (a pipeline stage: Paddle's grad ops
            # carry their forward op's op_device the same way).
            if device := (op.attr(OP_DEVICE_ATTR) if op.has_attr(OP_DEVICE_ATTR) else ""):
                for desc in made:
                    desc.attrs.setdefault(OP_DEVICE_ATTR, device)
            descs += made
    descs = _complete(block, descs)

    params = _parameters(program, parameter_list)
    param_grads = {grad_var_name(p.name): p for p in params}
    for i, desc in enumerate(descs):
        _declare_grad_vars(block, desc)
        role = OpRole.Backward | OpRole.Loss if i == 0 else OpRole.Backward
        attrs = dict(desc.attrs)
        attrs[OP_ROLE_ATTR] = int(role)
        written = [n for names in desc.outputs.values() for n in names if n in param_grads]
        attrs[OP_ROLE_VAR_ATTR] = [x for n in written for x in (param_grads[n].name, n)]
        REGISTRY.append_op(block, desc.type, desc.inputs, desc.outputs, attrs)
    return [(p, block.var(grad_var_name(p.name))) for p in params if grad_var_name(p.name) in block.vars]


def _no_grad_names(block: Block, extra: Iterable[Variable | str] | None) -> set[str]:
    """Variables whose gradient is not wanted: stop_gradient, non-float, or given."""
    names = {v.name if isinstance(v, Variable) else str(v) for v in (extra or ())}
    for var in block.vars.values():
        if var.stop_gradient or (var.dtype is not None and var.dtype not in FLOAT_TYPES):
            names.add(var.name)
    return names | _NO_GRAD


def _op_path(block: Block, loss_name: str, no_grad: set[str]) -> list:
    """The ops the loss depends on through differentiable variables, in program order."""
    end = max((i for i, op in enumerate(block.ops) if loss_name in op.output_arg_names), default=-1)
    relevant = {loss_name}
    path = []
    for op in reversed(block.ops[: end + 1]):
        if relevant.intersection(op.output_arg_names):
            path.append(op)
            relevant.update(n for n in op.input_arg_names if n not in no_grad)
    path.reverse()
    return path


@dataclass
class _Writes:
    """The versions of one gradient written so far, not yet summed."""

    versions: list[str] = field(default_factory=list)
    writers: list[tuple[int, str]] = field(default_factory=list)  # (desc index, slot)
    read: bool = False  # once read, a later write starts a new gradient


def _complete(block: Block, descs: list[GradOpDesc]) -> list[GradOpDesc]:
    """Rename repeated gradient writes and sum them before use; zero-fill or
    drop grad ops whose output gradients were never produced."""
    out: list[GradOpDesc] = []
    writes: dict[str, _Writes] = {}
    counter: dict[str, int] = {}

    def flush(name: str) -> None:
        w = writes[name]
        if len(w.versions) > 1:
            out.append(GradOpDesc("sum", {"X": list(w.versions)}, {"Out": [name]}))
            writes[name] = _Writes([name], [(len(out) - 1, "Out")])

    for desc in descs:
        inputs = {slot: list(names) for slot, names in desc.inputs.items()}
        grad_reads = [n for names in inputs.values() for n in names if n.endswith(GRAD_SUFFIX)]
        missing = [n for n in grad_reads if n not in writes]
        if grad_reads and len(missing) == len(grad_reads):
            continue  # none of this op's output gradients exist: it contributes nothing
        for name in grad_reads:
            if name in writes:
                flush(name)
                writes[name].read = True
        for name in dict.fromkeys(missing):
            base = name[: -len(GRAD_SUFFIX)]
            out.append(GradOpDesc("fill_zeros_like", {"X": [base]}, {"Out": [name]}))
            writes[name] = _Writes([name], [(len(out) - 1, "Out")])
        outputs = {slot: list(names) for slot, names in desc.outputs.items()}
        index = len(out)
        for slot, names in outputs.items():
            for k, name in enumerate(names):
                if name == EMPTY_VAR_NAME:
                    continue
                if name not in writes or writes[name].read:
                    writes[name] = _Writes([name], [(index, slot)])
                    continue
                w = writes[name]
                if len(w.versions) == 1 and w.versions[0] == name:
                    # Second write: give the first one a new name too.
                    first_index, first_slot = w.writers[0]
                    renamed = _rename(name, block, counter)
                    first = out[first_index]
                    first.outputs[first_slot] = [
                        renamed if n == name else n for n in first.outputs[first_slot]
                    ]
                    w.versions = [renamed]
                renamed = _rename(name, block, counter)
                names[k] = renamed
                w.versions.append(renamed)
                w.writers.append((index, slot))
        out.append(GradOpDesc(desc.type, inputs, outputs, dict(desc.attrs)))
    for name in list(writes):
        flush(name)
    return out


def _rename(name: str, block: Block, counter: dict[str, int]) -> str:
    k = counter.get(name, 0)
    counter[name] = k + 1
    return f"{name}{RENAME_SUFFIX}block{block.idx}@{k}"


def _forward_name(grad_name: str) -> str:
    """x@GRAD@RENAME@block0@1 -> x."""
    return grad_name.split(RENAME_SUFFIX, 1)[0][: -len(GRAD_SUFFIX)]


def _declare_grad_vars(block: Block, desc: GradOpDesc) -> None:
    """Gradient variables take their forward variable's shape and dtype; the
    grad op's inference then refines them (e.g. to SelectedRows)."""
    for names in desc.outputs.values():
        for name in names:
            if name == EMPTY_VAR_NAME or name in block.vars or GRAD_SUFFIX not in name:
                continue
            base = block.find_var(_forward_name(name))
            if base is None:
                raise BuilderError(f"append_backward: gradient {name!r} has no forward variable")
            block.create_var(name, shape=base.shape, dtype=base.dtype)


def _parameters(program, parameter_list: Sequence[Parameter | str] | None) -> list[Parameter]:
    if parameter_list is None:
        return [p for p in program.all_parameters() if p.trainable]
    params = []
    block = program.global_block()
    for p in parameter_list:
        name = p.name if isinstance(p, Variable) else p
        var = block.vars.get(name)
        if not isinstance(var, Parameter):
            raise BuilderError(
                f"append_backward: {name!r} in parameter_list is not a parameter of the program"
            )
        params.append(var)
    return params

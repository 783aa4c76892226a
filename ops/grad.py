"""Grad makers as data, and the `<type>_grad` schemas they imply.

Most Fluid ops differentiate the same way: a `<type>_grad` op reads some of
the forward op's inputs and outputs plus the gradients of its outputs
(`Out@GRAD`) and writes the gradients of its inputs (`X@GRAD`). A `GradSpec`
says which; `grad_schema` derives the grad op's definition from it, so the
gradient table of every op fits on a line.

A grad op's kernel indexes its inputs as its forward op's would (an activation's
gradient loops over Out and reads Out@GRAD at the same positions), so every derived
schema's inference first checks the grad op against its forward op (`_checked`): the
forward op's own inference, run on the forward inputs the grad op reads (or their
stand-ins, GradSpec.like), checks the attributes and gives each forward output's
shape, which each `S@GRAD` (and `S`, when read) must have.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fluidps.errors import ShapeError
from fluidps.ir.infer import InferContext, VarInfo
from fluidps.ir.operator import Operator
from fluidps.ir.opschema import GradContext, GradOpDesc, InferFn, OpSchema, Slot
from fluidps.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, dtype_name
from fluidps.ir.verify import shapes_compatible


@dataclass(frozen=True)
class GradSpec:
    """The default grad maker.

    inputs / outputs: forward slots the grad op reads.
    out_grads: forward outputs whose gradients it reads.
    in_grads: forward inputs it writes gradients for.
    like: where an input gradient's shape comes from when the forward input
      itself is not read, as (input slot, grad-op slot) pairs; "XShape" means
      the recorded input shape (Fluid's XShape: [0] + shape).
    infer: replaces the derived inference (e.g. sparse gradients).
    """

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    out_grads: tuple[str, ...] = ("Out",)
    in_grads: tuple[str, ...] = ("X",)
    like: tuple[tuple[str, str], ...] = ()
    infer: InferFn | None = None

    def __call__(self, ctx: GradContext) -> list[GradOpDesc]:
        outputs = {s + GRAD_SUFFIX: ctx.input_grad(s) for s in self.in_grads}
        outputs = {k: v for k, v in outputs.items() if v}
        if not outputs:
            return []
        inputs = {s: ctx.input(s) for s in self.inputs}
        inputs |= {s: ctx.output(s) for s in self.outputs}
        inputs |= {s + GRAD_SUFFIX: ctx.output_grad(s) for s in self.out_grads}
        return [GradOpDesc(ctx.op.type + "_grad", inputs, outputs, ctx.attrs())]


def grad_schema(forward: OpSchema, spec: GradSpec) -> OpSchema:
    """The schema of `<forward>_grad`: every forward slot may be read (Paddle's
    grad ops read different subsets across releases), every input gradient
    may be written, and attributes are the forward op's."""
    dispensable = [Slot(s.name, s.duplicable, True, s.extra) for s in forward.inputs + forward.outputs]
    out_grads = [Slot(s.name + GRAD_SUFFIX, s.duplicable, True) for s in forward.outputs]
    in_grads = [Slot(s.name + GRAD_SUFFIX, s.duplicable, True) for s in forward.inputs if not s.extra]
    return OpSchema(
        type=forward.type + "_grad",
        inputs=tuple(dispensable + out_grads),
        outputs=tuple(in_grads),
        attrs=forward.attrs,
        infer=_checked(forward, spec, spec.infer or _derived_infer(forward, spec)),
        doc=f"Gradient of {forward.type}.",
    )


def _derived_infer(forward: OpSchema, spec: GradSpec) -> InferFn:
    like = dict(spec.like)

    def infer(ctx: InferContext) -> None:
        for slot in forward.inputs:
            out_slot = slot.name + GRAD_SUFFIX
            for i, name in enumerate(ctx.op.output(out_slot)):
                if name == EMPTY_VAR_NAME:
                    continue
                source = _gradient_source(ctx, slot.name, like.get(slot.name), i)
                if source is not None:
                    ctx.share(out_slot, source, index=i)

    return infer


def _gradient_source(ctx: InferContext, slot: str, like: str | None, index: int) -> VarInfo | None:
    """The VarInfo an input gradient takes its shape from."""
    names = ctx.op.input(slot)
    if index < len(names) and names[index] != EMPTY_VAR_NAME:
        return ctx.lookup(names[index])
    if like is None:
        return None
    infos = ctx.inputs(like)
    if not infos:
        return None
    info = infos[min(index, len(infos) - 1)]
    if like == "XShape" and info.shape is not None:
        return replace(info, shape=info.shape[1:])
    return info


# -- the grad op checked against its forward op ----------------------------------------------


def _checked(forward: OpSchema, spec: GradSpec, infer: InferFn) -> InferFn:
    """`infer` (the grad op's own inference) after three rules, then a fourth:
    1. the forward op's inference, on the grad op's forward inputs (or their stand-ins,
       spec.like) and attributes, must pass: it checks axis, dims, ksize, strides, ...;
    2. each forward output `S` the grad op reads must have the shape it gives;
    3. each `S@GRAD` must have S's shape and dtype (as inferred, else as read);
    4. each `X@GRAD` inferred must have the shape and dtype of X (or its stand-in)."""
    like = dict(spec.like)

    def checked(ctx: InferContext) -> None:
        sources = _forward_inputs(ctx, forward, like)
        expected = _forward_outputs(ctx, forward, sources)
        for slot in forward.outputs:
            for i, name in enumerate(ctx.op.input(slot.name)):
                if (want := expected.get((slot.name, i))) is not None and name != EMPTY_VAR_NAME:
                    _agree(ctx, slot.name, ctx.lookup(name), want, f"the forward op's {slot.name}")
            read = ctx.op.input(slot.name)
            for i, name in enumerate(ctx.op.input(slot.name + GRAD_SUFFIX)):
                want = expected.get((slot.name, i))
                if want is None and i < len(read) and read[i] != EMPTY_VAR_NAME:
                    want = ctx.lookup(read[i])
                if want is not None and name != EMPTY_VAR_NAME:
                    _agree(
                        ctx, slot.name + GRAD_SUFFIX, ctx.lookup(name), want, f"forward output {slot.name}"
                    )
        infer(ctx)
        for (slot, i), source in sources.items():
            names = ctx.op.output(slot + GRAD_SUFFIX)
            if i < len(names) and (made := ctx.results.get(names[i])) is not None:
                _agree(ctx, slot + GRAD_SUFFIX, made, source, f"forward input {slot}")

    return checked


def _forward_inputs(
    ctx: InferContext, forward: OpSchema, like: dict[str, str]
) -> dict[tuple[str, int], VarInfo]:
    """(forward input slot, index) -> what the grad op knows of that input: the variable
    it reads, else its stand-in (GradSpec.like)."""
    known: dict[tuple[str, int], VarInfo] = {}
    for slot in forward.inputs:
        names = ctx.op.input(slot.name)
        for i, name in enumerate(names):
            if name != EMPTY_VAR_NAME and (info := ctx.lookup(name)) is not None:
                known[(slot.name, i)] = info
        if not names and slot.name in like:
            for i, _ in enumerate(ctx.op.output(slot.name + GRAD_SUFFIX) or [EMPTY_VAR_NAME]):
                info = _gradient_source(ctx, slot.name, like[slot.name], i)
                if info is not None:
                    known[(slot.name, i)] = info
    return known


def _forward_outputs(
    ctx: InferContext, forward: OpSchema, sources: dict[tuple[str, int], VarInfo]
) -> dict[tuple[str, int], VarInfo]:
    """(forward output slot, index) -> its VarInfo as the forward op's inference makes it
    from `sources` and the grad op's attributes; {} when a required input is unknown."""
    if forward.infer is None:
        return {}
    inputs: dict[str, list[str]] = {}
    infos: dict[str, VarInfo] = {}
    for (slot, _), info in sorted(sources.items()):
        if info.shape is None:
            return {}
        key = info.name if info == ctx.lookup(info.name) else f"{info.name} (as {slot})"
        inputs.setdefault(slot, []).append(key)
        infos[key] = info
    if any(not s.dispensable and s.name not in inputs for s in forward.inputs):
        return {}
    outputs: dict[str, list[str]] = {}
    for slot in forward.outputs:  # named as the grad op reads them, else stand-ins: their gradients
        read, grads = ctx.op.input(slot.name), ctx.op.input(slot.name + GRAD_SUFFIX)
        for i in range(_output_count(ctx, slot)):
            if i < len(read) and read[i] != EMPTY_VAR_NAME:
                outputs.setdefault(slot.name, []).append(read[i])
                continue
            name = f"{slot.name}#{i}"
            if i < len(grads) and grads[i] != EMPTY_VAR_NAME and (grad := ctx.lookup(grads[i])) is not None:
                infos[name] = grad  # (an inference that reads its output's declaration, for a width)
            outputs.setdefault(slot.name, []).append(name)
    attrs = {n: ctx.op.attr(n) for n in ctx.op.attr_names}
    types = {n: ctx.op.attr_type(n) for n in ctx.op.attr_names}
    op = Operator(None, forward.type, inputs, outputs, attrs, types)
    fctx = InferContext(op, forward, lambda n: infos.get(n) or ctx.lookup(n))
    try:
        forward.infer(fctx)
    except ShapeError as e:  # the forward op's words, said of the grad op
        why = str(e).removeprefix(f"op {forward.type!r}: ")
        raise ShapeError(f"op {ctx.type!r} (checked as its forward op {forward.type!r}): {why}") from None
    made = {}
    for slot, names in outputs.items():
        for i, name in enumerate(names):
            if name in fctx.results:  # named as the grad op reads it, or as the forward op makes it
                shown = name if name != f"{slot}#{i}" else f"{forward.type}'s {slot}"
                made[(slot, i)] = replace(fctx.results[name], name=shown)
    return made


def _output_count(ctx: InferContext, slot: Slot) -> int:
    count = max(len(ctx.op.input(slot.name)), len(ctx.op.input(slot.name + GRAD_SUFFIX)))
    return count if slot.duplicable else 1


def _agree(ctx: InferContext, slot: str, got: VarInfo | None, want: VarInfo, of: str) -> None:
    """`got` (the grad op's `slot`) must have the shape and dtype of `want`."""
    if got is None or got.shape is None:
        return
    if shapes_compatible(got.shape, want.shape) and (
        got.dtype is None or want.dtype is None or got.dtype == want.dtype
    ):
        return
    shape = "?" if want.shape is None else list(want.shape)
    ctx.fail(
        f"{slot} ({got.describe()}) does not match {of} ({want.describe()}): it must have shape "
        f"{shape} (-1: any size) and dtype {dtype_name(want.dtype)}; fix the program that "
        f"computes or feeds {got.name!r}"
    )

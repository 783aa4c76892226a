"""The op registry: every op definition, and appending ops by their definition.

Op modules collect their schemas in an `OpFamily` with a decorator; the one
explicit list in `fluidps.ops.all_ops` builds the immutable `OpRegistry`.
Nothing registers itself by import side effect.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from fluidps.errors import ProgramError, ShapeError, UnknownOpError, UnsupportedError
from fluidps.ir.infer import InferContext, VarInfo
from fluidps.ir.operator import Operator, SlotArgs
from fluidps.ir.opschema import REQUIRED, AttrSpec, GradMaker, InferFn, OpSchema, Slot
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME
from fluidps.ops.grad import GradSpec, grad_schema
from fluidps.ops.kernel import KernelBuilder, KernelOp, Runner
from fluidps.ops.lowering import BatchForm, ElementForm, Lowering, LoweringOp, NotLowerable
from fluidps.ops.runtime_api import KernelRuntime

# Common attributes the builder writes on every op; the others (name scopes,
# call stacks) are Paddle bookkeeping that fluidps leaves out.
_FILLED_COMMON = ("op_role", "op_role_var")


class OpFamily:
    """The ops one module defines. Use `@family.op(...)` on an infer function,
    or `family.define(...)` for ops with nothing to infer, and
    `@family.kernel(type)` on a kernel builder."""

    def __init__(self, name: str):
        self.name = name
        self.schemas: list[OpSchema] = []
        self.kernels: dict[str, KernelBuilder] = {}
        self.lowerings: dict[str, Lowering] = {}
        self.elements: dict[str, ElementForm] = {}
        self.batches: dict[str, BatchForm] = {}

    def kernel(self, *types: str) -> Callable[[KernelBuilder], KernelBuilder]:
        """Register a kernel builder for one or more op types."""
        return self._registrar(self.kernels, types, "kernels")

    def lowering(self, *types: str) -> Callable[[Lowering], Lowering]:
        """Register the compiled form of one or more op types (fluidps.ops.lowering)."""
        return self._registrar(self.lowerings, types, "lowerings")

    def elementwise(self, type: str, form: ElementForm) -> None:
        """Register how op `type` computes one element (fluidps.ops.lowering.ElementForm):
        the compiler fuses runs of such ops into one loop. The op needs a lowering too."""
        self._registrar(self.elements, (type,), "element forms")(form)

    def batched(self, type: str, form: BatchForm) -> None:
        """Register how consecutive ops `type` run as one loop over their parameters
        (fluidps.ops.lowering.BatchForm). The op needs a lowering too."""
        self._registrar(self.batches, (type,), "batch forms")(form)

    def _registrar(self, table: dict[str, Any], types: tuple[str, ...], what: str) -> Callable[[Any], Any]:
        def register(fn: Any) -> Any:
            for op_type in types:
                if op_type in table:
                    raise ProgramError(f"op {op_type!r} has two {what} in {self.name}")
                table[op_type] = fn
            return fn

        return register

    def op(
        self,
        type: str,
        *,
        inputs: Sequence[Slot] = (),
        outputs: Sequence[Slot] = (),
        attrs: Sequence[AttrSpec] = (),
        grad: GradMaker | None = None,
    ) -> Callable[[InferFn], InferFn]:
        def register(infer: InferFn) -> InferFn:
            self.define(type, inputs=inputs, outputs=outputs, attrs=attrs, grad=grad, infer=infer)
            return infer

        return register

    def define(
        self,
        type: str,
        *,
        inputs: Sequence[Slot] = (),
        outputs: Sequence[Slot] = (),
        attrs: Sequence[AttrSpec] = (),
        grad: GradMaker | None = None,
        infer: InferFn | None = None,
    ) -> None:
        doc = (infer.__doc__ or "").strip() if infer is not None else ""
        self.schemas.append(OpSchema(type, tuple(inputs), tuple(outputs), tuple(attrs), infer, grad, doc))


class OpRegistry(Mapping[str, OpSchema]):
    """type -> OpSchema for every forward op and its derived `<type>_grad`."""

    def __init__(self, families: Iterable[OpFamily]):
        schemas: dict[str, OpSchema] = {}
        kernels: dict[str, KernelBuilder] = {}
        lowerings: dict[str, Lowering] = {}
        elements: dict[str, ElementForm] = {}
        batches: dict[str, BatchForm] = {}
        for family in families:
            for schema in family.schemas:
                if schema.type in schemas:
                    raise ProgramError(f"op {schema.type!r} is defined twice (second time in {family.name})")
                schemas[schema.type] = schema
            for op_type, builder in family.kernels.items():
                if op_type in kernels:
                    raise ProgramError(f"op {op_type!r} has two kernels (second in {family.name})")
                kernels[op_type] = builder
            for op_type, lowering in family.lowerings.items():
                if op_type in lowerings or op_type not in family.kernels:
                    raise ProgramError(
                        f"op {op_type!r} needs one kernel and at most one lowering ({family.name})"
                    )
                lowerings[op_type] = lowering
            for op_type, form in family.elements.items():
                if op_type in elements or op_type not in family.lowerings:
                    raise ProgramError(
                        f"op {op_type!r} needs one lowering and at most one element form ({family.name})"
                    )
                elements[op_type] = form
            for op_type, batch in family.batches.items():
                if op_type in batches or op_type not in family.lowerings:
                    raise ProgramError(
                        f"op {op_type!r} needs one lowering and at most one batch form ({family.name})"
                    )
                batches[op_type] = batch
        for schema in list(schemas.values()):
            if isinstance(schema.grad, GradSpec) and schema.type + "_grad" not in schemas:
                schemas[schema.type + "_grad"] = grad_schema(schema, schema.grad)
        self._schemas = MappingProxyType(schemas)
        unknown = set(kernels) - set(schemas)
        if unknown:
            raise ProgramError(f"kernels for undefined ops: {sorted(unknown)}")
        self._kernels = MappingProxyType(kernels)
        self._lowerings = MappingProxyType(lowerings)
        self._elements = MappingProxyType(elements)
        self._batches = MappingProxyType(batches)

    def __getitem__(self, type: str) -> OpSchema:
        return self._schemas[type]

    def __iter__(self) -> Iterator[str]:
        return iter(self._schemas)

    def __len__(self) -> int:
        return len(self._schemas)

    def schema(self, type: str) -> OpSchema:
        """The schema of `type`; an UnknownOpError suggesting close names otherwise."""
        if type in self._schemas:
            return self._schemas[type]
        close = difflib.get_close_matches(type, list(self._schemas), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownOpError(f"unknown op type {type!r}{hint}")

    def has_kernel(self, type: str) -> bool:
        return type in self._kernels

    def has_lowering(self, type: str) -> bool:
        """Whether `type` has a compiled form (which may still decline a configuration)."""
        return type in self._lowerings

    def lower(
        self, op: Operator, local: Callable[[str], str], helper: Callable[[Callable[..., Any]], str]
    ) -> LoweringOp:
        """`op` lowered for a compiled block (fluidps.ops.lowering): its statements in
        `.lines`; raises NotLowerable when it has none (it then runs interpreted)."""
        lowering = self._lowerings.get(op.type)
        if lowering is None:
            raise NotLowerable(f"op {op.type!r} has no lowering")
        schema = self.schema(op.type)
        self._check_implemented(op, schema)
        lowered = LoweringOp(op, schema, local, helper)
        lowering(lowered)
        return lowered

    def element_form(self, op: Operator) -> ElementForm | None:
        """How `op` computes one element, when it is elementwise as configured (None
        otherwise: it is lowered on its own)."""
        form = self._elements.get(op.type)
        if form is None or op.type not in self._lowerings:
            return None
        self._check_implemented(op, self.schema(op.type))
        return form

    def batch_form(self, type: str) -> BatchForm | None:
        """How consecutive ops `type` run as one loop over their parameters, if they can."""
        return self._batches.get(type)

    def build_kernel(self, op: Operator, runtime: KernelRuntime | None = None) -> Runner:
        """The runner of `op`: its kernel builder applied to the op. Kernels of ops that
        take part in a job (send, listen_and_serv, read, ...) need the process's `runtime`."""
        schema = self.schema(op.type)
        builder = self._kernels.get(op.type)
        if builder is None:
            raise UnsupportedError(
                f"op {op.type!r} has no kernel in fluidps, so programs using it cannot run"
            )
        self._check_implemented(op, schema)
        return builder(KernelOp(op, schema, runtime))

    @staticmethod
    def _check_implemented(op: Operator, schema: OpSchema) -> None:
        """A program parsed from a file (never built, never verified) may still ask for
        what the kernels ignore: an extra slot Paddle added, an attribute value fluidps
        does not implement. Running it would silently compute something else."""
        for kind, given, lookup in (
            ("input", op.inputs, schema.input_slot),
            ("output", op.outputs, schema.output_slot),
        ):
            for name, args in given.items():
                slot = lookup(name)
                if slot is not None and slot.extra and any(a != EMPTY_VAR_NAME for a in args):
                    raise UnsupportedError(
                        f"op {op.type!r}: {kind} {name!r} ({', '.join(args)}) is not implemented by fluidps"
                    )
        for name in op.attr_names:
            spec = schema.attr_spec(name)
            if spec is not None:
                _check_supported(op.type, spec, op.attr(name))

    # -- building ------------------------------------------------------------------------

    def append_op(
        self,
        block: Block,
        type: str,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
        *,
        index: int | None = None,
    ) -> Operator:
        """Append (or insert at `index`) an op checked against its schema: attributes
        typed and completed with defaults, output shapes and dtypes inferred.
        Nothing is added to the block when a check fails."""
        schema = self.schema(type)
        attrs = dict(attrs or {})
        types = {}
        for name, value in attrs.items():
            spec = schema.attr_spec(name)
            if spec is None:
                known = ", ".join(a.name for a in schema.attrs) or "none"
                raise ProgramError(f"op {type!r} has no attribute {name!r} (its attributes: {known})")
            _check_supported(type, spec, value)
            types[name] = spec.type
        for spec in schema.all_attr_specs:
            own = spec in schema.attrs and not spec.extra
            if spec.name in attrs or not (own or spec.name in _FILLED_COMMON):
                continue
            if spec.default is REQUIRED:
                raise ProgramError(f"op {type!r} needs attribute {spec.name!r} ({spec.type.name})")
            attrs[spec.name] = spec.default
            types[spec.name] = spec.type
        op = Operator(block, type, inputs, outputs, attrs, types)
        self._check_slots(op, schema)
        results = self._infer(op, block)
        for name, info in results.items():
            var = block.find_var(name)
            if var is None:
                raise ProgramError(
                    f"op {type!r} writes {name!r}, which is not declared; create the variable first"
                )
            var.type, var.dtype, var.shape, var.lod_level = info.type, info.dtype, info.shape, info.lod_level
        block._insert_operator(len(block.ops) if index is None else index, op)
        return op

    def _infer(self, op: Operator, block: Block) -> dict[str, VarInfo]:
        def lookup(name: str) -> VarInfo | None:
            var = block.find_var(name)
            return None if var is None else VarInfo.of(var)

        return self.infer(op, lookup)

    def infer(self, op: Operator, lookup: Callable[[str], VarInfo | None]) -> dict[str, VarInfo]:
        """Run `op`'s shape inference on what `lookup` says of its variables (the
        block's declarations, or the values a kernel was given); raises ShapeError."""
        schema = self.schema(op.type)
        if schema.infer is None:
            return {}
        ctx = InferContext(op, schema, lookup)
        schema.infer(ctx)
        return ctx.results

    @staticmethod
    def _check_slots(op: Operator, schema: OpSchema) -> None:
        for kind, given, lookup in (
            ("input", op.inputs, schema.input_slot),
            ("output", op.outputs, schema.output_slot),
        ):
            for name, args in given.items():
                slot = lookup(name)
                if slot is None:
                    raise ProgramError(f"op {op.type!r} has no {kind} slot {name!r}")
                if slot.extra and args:
                    raise UnsupportedError(f"op {op.type!r}: {kind} {name!r} is not implemented by fluidps")
                if not slot.duplicable and len(args) > 1:
                    raise ShapeError(f"op {op.type!r}: {kind} slot {name!r} takes one variable, got {args}")


def _check_supported(op_type: str, spec: AttrSpec, value: Any) -> None:
    if spec.supported is not None and not spec.supported(value):
        hint = f": {spec.hint}" if spec.hint else ""
        raise UnsupportedError(f"op {op_type!r}: {spec.name}={value!r} is not implemented{hint}")

"""Elementwise fusion: a run of elementwise ops becomes one loop nest.

Ops that register an ElementForm (fluidps.ops.lowering) compute each element of
their outputs from the same element of their inputs (or, for a broadcast
operand, a bias, from the element it lines up with). A run of them where each
op reads what an earlier one wrote is lowered as one loop over the elements: a
value passed along the run stays a scalar, and only what is read after the run
is stored, into arrays allocated once. So `mul + elementwise_add + relu` (an fc
with an activation) is the product and one pass over it, and the backward
`relu_grad + elementwise_add_grad` one pass that writes the pre-activation
gradient and sums the bias gradient on the way, in the order sum_pre_post sums.

Which op may join a run is decided by the rules of JOIN_RULES, one table; an op
that breaks one starts a new run. Every op calls the element function its kernel
calls, and each value is rounded to its variable's dtype where the kernel would
store it, so a fused run gives the interpreter's bits. Operands are checked at
run time (numba does no bounds checks): a mismatch raises, and the block's
interpreter reruns the segment and says which op and shapes do not fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fluidps.executor.compiler.batching import Batch
from fluidps.ir.operator import Operator
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, to_numpy_dtype
from fluidps.ops import REGISTRY
from fluidps.ops.lowering import ElementForm, LoweringOp, NotLowerable, Spread, product

_FLOATS = (VarType.FP32, VarType.FP64)


@dataclass
class Elementwise:
    """One op of a run, as the fusion sees it."""

    op: Operator
    form: ElementForm
    spread: dict[str, Spread]  # its broadcast slots
    rank: int  # of its elementwise domain (its first full input)

    def vars_of(self, slots: Sequence[str]) -> list[tuple[str, str]]:
        """(slot, variable) of `slots` that name one."""
        out = []
        for slot in slots:
            names = [
                n
                for n in (self.op.inputs.get(slot) or self.op.outputs.get(slot) or [])
                if n != EMPTY_VAR_NAME
            ]
            if len(names) == 1:
                out.append((slot, names[0]))
        return out

    @property
    def reads(self) -> list[tuple[str, str]]:
        return self.vars_of(self.form.inputs)

    @property
    def writes(self) -> list[tuple[str, str]]:
        return self.vars_of(self.form.outputs)

    def all_inputs(self) -> list[tuple[str, str]]:
        """Every (slot, variable) the op takes, read by its element function or not (a
        gradient op's X and Y give shapes): each is checked against the loop."""
        return [(s, n) for s, names in self.op.inputs.items() for n in names if n != EMPTY_VAR_NAME]


def elementwise(op: Operator) -> Elementwise | None:
    """`op` as a member of a fused run; None when it has no element form as configured
    (or operands other than dense float tensors): it is lowered on its own."""
    form = REGISTRY.element_form(op)
    if form is None:
        return None
    lowering = LoweringOp(op, REGISTRY.schema(op.type), lambda n: n, lambda f: "")
    try:
        spread = form.spread(lowering) if form.spread is not None else {}
        domain = next(s for s in form.inputs if s not in spread)
        slots = [
            s
            for s, names in (*op.inputs.items(), *op.outputs.items())
            if any(n != EMPTY_VAR_NAME for n in names)
        ]
        lowering.require_dense(*slots)
        if any(
            s not in form.outputs
            for s, names in op.outputs.items()
            if any(n != EMPTY_VAR_NAME for n in names)
        ):
            return None  # an output its element function does not give
        if any(
            lowering.variable(n).dtype not in _FLOATS
            for n in op.input_arg_names + op.output_arg_names
            if n != EMPTY_VAR_NAME
        ):
            return None
        return Elementwise(op, form, spread, lowering.rank(domain))
    except (NotLowerable, StopIteration):
        return None


@dataclass
class Run:
    """Ops fused into one loop: what they write (variable -> its latest writer's
    position in the run) and how the run broadcasts."""

    members: list[Elementwise] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=dict)
    spread_written: set[str] = field(default_factory=set)
    spread: Spread | None = None

    def add(self, e: Elementwise) -> None:
        for slot, name in e.writes:
            self.written[name] = len(self.members)
            if slot in e.spread:
                self.spread_written.add(name)
            else:
                self.spread_written.discard(name)
        self.spread = self.spread or next(iter(e.spread.values()), None)
        self.members.append(e)

    def unstored(self, read_after: Callable[[str], bool]) -> list[str]:
        """The variables the run computes that are never arrays: passed along as scalars."""
        return [n for n in self.written if not read_after(n)]

    def written_before(self, name: str, k: int) -> bool:
        return any(name == n for m in self.members[:k] for _, n in m.writes)

    def operands(self) -> list[tuple[int, str, str]]:
        """(member, slot, variable) of what the run reads from outside it (every input
        slot: a gradient op's X and Y give shapes even when its element function does
        not read them)."""
        return [
            (k, slot, name)
            for k, member in enumerate(self.members)
            for slot, name in member.all_inputs()
            if not self.written_before(name, k)
        ]

    def spread_operands(self) -> set[str]:
        return {name for k, slot, name in self.operands() if slot in self.members[k].spread}

    def full_operands(self) -> list[str]:
        spread = self.spread_operands()
        return list(dict.fromkeys(name for _, _, name in self.operands() if name not in spread))

    def last_reader(self, name: str) -> int:
        """The last member that takes `name` from outside the run."""
        return max(k for k, _, n in self.operands() if n == name)

    def stored_full(self, read_after: Callable[[str], bool]) -> list[tuple[int, str, Any]]:
        """(member, variable, its declaration) of each array the run stores whole (the
        last value of a variable read after it)."""
        unstored = set(self.unstored(read_after))
        return [
            (k, name, member.op.block.find_var(name))
            for k, member in enumerate(self.members)
            for slot, name in member.writes
            if self.written[name] == k and name not in unstored and slot not in member.spread
        ]


# What an op needs to join a run, one rule a line: an op breaking one starts a new run.
JOIN_RULES: tuple[tuple[str, Callable[[Run, Elementwise], bool]], ...] = (
    ("it reads a value the run computes", lambda run, e: any(n in run.written for _, n in e.reads)),
    (
        "it reads the run's values element by element (not as a broadcast operand, not a sum)",
        lambda run, e: all(
            n not in run.written or (s not in e.spread and n not in run.spread_written) for s, n in e.reads
        ),
    ),
    ("it has the run's rank", lambda run, e: e.rank == run.members[0].rank),
    (
        "it broadcasts as the run does",
        lambda run, e: run.spread is None or all(s == run.spread for s in e.spread.values()),
    ),
)


def breaks(run: Run, e: Elementwise) -> str | None:
    """None when `e` may join `run`, else the rule it breaks."""
    return next((rule for rule, check in JOIN_RULES if not check(run, e)), None)


def group(ops: Sequence[Operator]) -> list[Run | Operator]:
    """`ops` in order, as fused runs (of two ops or more) and single ops."""
    out: list[Run | Operator] = []
    run: Run | None = None
    for op in [*ops, None]:
        e = elementwise(op) if op is not None else None
        if e is not None and run is not None and breaks(run, e) is None:
            run.add(e)
            continue
        if run is not None:
            out.append(run if len(run.members) > 1 else run.members[0].op)
        run = None
        if e is not None:
            run = Run()
            run.add(e)
        elif op is not None:
            out.append(op)
    return out


def lower_run(
    run: Run,
    local: Callable[[str], str],
    helper: Callable[[Callable[..., Any]], str],
    fresh: Callable[[], str],
    read_after: Callable[[str], bool],
    reuse: Mapping[str, Any] = MappingProxyType({}),
) -> list[str]:
    """The statements of one fused loop. `fresh()` names a new local; `read_after(name)`
    says whether a variable is read after the run (by a later op, a fetch, the scope);
    `reuse`: per output stored, the dead array it takes (fluidps.executor.compiler.buffers)."""
    first = run.members[0]
    domain = local(dict(first.reads)[next(s for s in first.form.inputs if s not in first.spread)])
    spread = run.spread
    lines: list[str] = []

    # The loop nest: the dimensions before a broadcast operand's, its own, and those
    # after, each a loop where there are some; one flat loop when nothing broadcasts.
    if spread is None:
        levels = [(f"{domain}.size", "i")]
    else:
        parts = (
            range(0, spread.start),
            range(spread.start, spread.start + spread.rank),
            range(spread.start + spread.rank, first.rank),
        )
        levels = [
            (product([f"{domain}.shape[{d}]" for d in dims]), f"i{k}")
            for k, dims in enumerate(parts)
            if len(dims) or k == 1
        ]
    full_view = "(" + ", ".join(extent for extent, _ in levels) + ",)"
    index = ", ".join(var for _, var in levels)
    spread_extent = dict((var, extent) for extent, var in levels).get("i1", "1")

    # Operands the run reads from outside: checked against the loop, then viewed as it indexes them.
    views: dict[str, str] = {}
    for k, slot, name in run.operands():
        if name in views:
            continue
        member = run.members[k]
        array, view = local(name), fresh()
        where = f"op {member.op.type!r}: {slot} {name!r}"
        if slot in member.spread:
            s = member.spread[slot]
            differ = " or ".join(
                f"{array}.shape[{j}] != {domain}.shape[{s.start + j}]" for j in range(s.rank)
            )
            lines += [
                f"if {differ}:",
                f"    raise ValueError({where + ' does not line up with the others'!r})",
            ]
            lines.append(f"{view} = {array}.reshape(-1)")
        else:
            if array != domain:
                lines += [
                    f"if {array}.shape != {domain}.shape:",
                    f"    raise ValueError({where + ' has another shape'!r})",
                ]
            lines.append(f"{view} = {array}.reshape({full_view})")
        views[name] = view

    # Outputs: an array for each variable read after the run (its last value), a sum for a broadcast one.
    unstored = set(run.unstored(read_after))
    stores: dict[tuple[int, str], str] = {}
    results: list[str] = []
    for k, member in enumerate(run.members):
        for slot, name in member.writes:
            if run.written[name] != k or name in unstored:
                continue
            dtype, buffer = _dtype(member, name), fresh()
            if slot in member.spread:
                lines.append(f"{buffer} = np.zeros({spread_extent}, np.{dtype})")
                operand = local(dict(member.all_inputs())[slot.removesuffix("@GRAD")])
                results.append(f"{local(name)} = {buffer}.reshape({operand}.shape)")
                stores[(k, name)] = buffer
            else:
                new = f"np.empty({domain}.shape, np.{dtype})"
                if (given := reuse.get(name)) is None:
                    lines.append(f"{buffer} = {new}")
                elif given.checked:  # an operand of the run: its shape is the loop's
                    lines.append(f"{buffer} = {local(given.donor)}  # {given.donor!r} is dead: its array")
                else:
                    donor = local(given.donor)
                    lines.append(f"{buffer} = {donor} if {donor}.shape == {domain}.shape else {new}")
                results.append(f"{local(name)} = {buffer}")
                stores[(k, name)] = view = fresh()
                lines.append(f"{view} = {buffer}.reshape({full_view})")

    # The loop: each op's element function on scalars, each result rounded to its
    # variable's dtype (where the kernel stores it), stored or summed if read after.
    pad = ""
    for extent, var in levels:
        lines.append(f"{pad}for {var} in range({extent}):")
        pad += "    "
    scalars: dict[str, str] = {}
    for k, member in enumerate(run.members):
        args = [
            scalars[name] if name in scalars else f"{views[name]}[{'i1' if slot in member.spread else index}]"
            for slot, name in member.reads
        ]
        got = [fresh() for _ in member.form.outputs]
        lines.append(f"{pad}{', '.join(got)} = {helper(member.form.fn)}({', '.join(args)})")
        wanted = dict(member.writes)
        for slot, value in zip(member.form.outputs, got, strict=True):
            if (name := wanted.get(slot)) is None:
                continue
            rounded = fresh()
            lines.append(f"{pad}{rounded} = np.{_dtype(member, name)}({value})")
            if slot not in member.spread:
                scalars[name] = rounded
            if (target := stores.get((k, name))) is not None:
                if slot in member.spread:
                    lines.append(f"{pad}{target}[i1] += {rounded}")
                else:
                    lines.append(f"{pad}{target}[{index}] = {rounded}")
    return lines + results


def describe(run: Run) -> str:
    return "+".join(m.op.type for m in run.members)


def ops_of(item: Run | Operator | Batch) -> list[Operator]:
    """The ops of a run or a batch of updates, or the one op."""
    if isinstance(item, Run):
        return [m.op for m in item.members]
    return list(item.ops) if isinstance(item, Batch) else [item]


def _dtype(member: Elementwise, name: str) -> str:
    return to_numpy_dtype(member.op.block.find_var(name).dtype).name

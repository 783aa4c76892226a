"""Each pserver's programs.

Main program: block 0 declares the slices this pserver owns and holds one
listen_and_serv op; sub-blocks hold the work it runs:
- the learning-rate block (op_role LRSched ops), once per step;
- one optimize block per slice: merge the gradient (sync: the trainers'
  copies `w@GRAD.block0.trainer_<i>` summed and scaled by 1/trainers, or, with
  one trainer, its gradient as it is; async / SSP: dequeued from the gradient's
  queue), then the slice's
  weight decay and optimizer ops on the slice and its sliced accumulators;
- async / SSP: one receive block per gradient that enqueues what arrives.
Blocks of distributed tables are listed in `distributed_tables`: trainers
prefetch their rows by id instead of pulling them whole.
Startup program: the original initializers of what this pserver owns, with
their shape rewritten to the slice; a hashed table's shard is told which shard it is.
"""

from __future__ import annotations

from collections.abc import Callable

from fluidps.errors import UnsupportedError
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import EMPTY_VAR_NAME, OP_ROLE_VAR_ATTR, OpRole, VarType
from fluidps.ops.distributed import MODE_NUMBERS
from fluidps.ops.roles import append_role_op
from fluidps.transpiler.analysis import ParamUpdate, ProgramRoles
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.plan import Placement, Slice


class _PserverBuilder:
    def __init__(
        self,
        program: Program,
        roles: ProgramRoles,
        slices: list[Slice],
        config: DistributeTranspilerConfig,
        trainers: int,
    ):
        self.origin = program.global_block()
        self.roles = roles
        self.slices = slices
        self.config = config
        self.trainers = trainers
        self.program = Program()
        self.global_block = self.program.global_block()
        # pserver persistable -> (original variable, the slice it was cut for, or None)
        self.origins: dict[str, tuple[str, Slice | None]] = {}
        self.lr_outputs = {n for i in roles.lr_ops for n in program.global_block().ops[i].output_arg_names}

    # -- declarations --------------------------------------------------------------------

    def declare_like(
        self,
        name: str,
        origin: str,
        *,
        shape=None,
        type=None,
        slice_: Slice | None = None,
        state: bool = True,
    ) -> None:
        """Declare `name` in block 0 after the original variable `origin`; persistable as it
        is, unless it is no `state` of the pserver (a gradient the trainers send: a pipeline
        stage's is persistable where it is summed, not here)."""
        if name in self.global_block.vars:
            return
        var = self.origin.var(origin)
        persistable = var.persistable and state
        self.global_block.create_var(
            name,
            shape=var.shape if shape is None else shape,
            dtype=var.dtype,
            type=var.type if type is None else type,
            persistable=persistable,
        )
        if persistable:
            self.origins[name] = (origin, slice_)

    def sub_block(self) -> Block:
        block = self.program.create_block(0)
        self.program.rollback()
        return block

    # -- blocks --------------------------------------------------------------------------

    def lr_block(self) -> int:
        if not self.roles.lr_ops:
            return -1
        block = self.sub_block()
        for i in self.roles.lr_ops:
            op = self.origin.ops[i]
            for name in op.input_arg_names + op.output_arg_names:
                if name != EMPTY_VAR_NAME:
                    self.declare_like(name, name)
            _copy_op(block, op, lambda n: n)
        return block.idx

    def optimize_block(self, s: Slice, update: ParamUpdate) -> tuple[int, int | None]:
        """(optimize block, receive block or None) of one slice."""
        sliced = len([t for t in self.slices if t.param == s.param]) > 1
        param = self.origin.var(s.param)
        self.declare_like(s.name, s.param, shape=s.shape, slice_=s if sliced else None)
        grad_type = VarType.SELECTED_ROWS if s.sparse else VarType.LOD_TENSOR
        grad_shape = (s.rows, *param.shape[1:])
        self.declare_like(s.grad, update.grad, shape=grad_shape, type=grad_type, state=False)
        block = self.sub_block()
        role_var = [s.name, s.grad]
        queue_block = None
        if self.config.mode == "sync" and self.trainers == 1:
            pass  # the one trainer's gradient is optimized as it arrives: nothing to merge
        elif self.config.mode == "sync":
            copies = [f"{s.grad}.trainer_{t}" for t in range(self.trainers)]
            for name in copies:
                self.declare_like(name, update.grad, shape=grad_shape, type=grad_type, state=False)
            append_role_op(
                block, "sum", {"X": copies}, {"Out": s.grad}, role=OpRole.Optimize, role_var=role_var
            )
            if self.trainers > 1:
                append_role_op(
                    block, "scale", {"X": s.grad}, {"Out": s.grad}, {"scale": 1.0 / self.trainers},
                    role=OpRole.Optimize, role_var=role_var,
                )  # fmt: skip
        else:
            append_role_op(
                block,
                "dequeue",
                {},
                {"Out": s.grad},
                {"queue_name": s.grad},
                role=OpRole.Optimize,
                role_var=role_var,
            )
            receive = self.sub_block()
            append_role_op(receive, "enqueue", {"X": s.grad}, {}, {"queue_name": s.grad}, role=OpRole.RPC)
            queue_block = receive.idx
        rename = self._renamer(s, update, sliced, block)
        for i in update.ops:
            _copy_op(block, self.origin.ops[i], rename)
        return block.idx, queue_block

    def _renamer(self, s: Slice, update: ParamUpdate, sliced: bool, block: Block) -> Callable[[str], str]:
        suffix = f".block{s.block_id}" if sliced else ""
        param_rows = self.origin.var(s.param).shape[0]

        def rename(name: str) -> str:
            if name == EMPTY_VAR_NAME:
                return name
            if name == s.param:
                return s.name
            if name == update.grad:
                return s.grad
            var = self.origin.var(name)
            if name in update.state:
                # Row-shaped state is cut like the parameter; scalars (beta powers) are copied.
                row_shaped = bool(var.shape) and var.shape[0] == param_rows
                shape = (s.rows, *var.shape[1:]) if row_shaped else var.shape
                self.declare_like(
                    name + suffix, name, shape=shape, slice_=s if (sliced and row_shaped) else None
                )
                return name + suffix
            if var.persistable or name in self.lr_outputs:
                self.declare_like(name, name)
                return name
            # A temporary of this slice's ops (weight decay, a scaled learning rate).
            if name + suffix not in block.vars:
                block.create_var(name + suffix, dtype=var.dtype, type=var.type)
            return name + suffix

        return rename


def _copy_op(block: Block, op: Operator, rename: Callable[[str], str]) -> Operator:
    inputs = {slot: [rename(n) for n in names] for slot, names in op.inputs.items()}
    outputs = {slot: [rename(n) for n in names] for slot, names in op.outputs.items()}
    attrs = op.all_attrs()
    if attrs.get(OP_ROLE_VAR_ATTR):
        attrs[OP_ROLE_VAR_ATTR] = [rename(n) for n in attrs[OP_ROLE_VAR_ATTR]]
    return append_role_op(
        block,
        op.type,
        inputs,
        outputs,
        attrs,
        role=OpRole(attrs.pop("op_role", 0)),
        role_var=attrs.pop(OP_ROLE_VAR_ATTR, []),
    )


def build_pserver_programs(
    program: Program,
    startup: Program,
    roles: ProgramRoles,
    slices: list[Slice],
    endpoint: str,
    pserver_id: int,
    config: DistributeTranspilerConfig,
    trainers: int,
) -> tuple[Program, Program, list[Placement]]:
    """(main, startup) of one pserver, and where the persistable variables it holds came from."""
    b = _PserverBuilder(program, roles, slices, config, trainers)
    lr_block_id = b.lr_block()
    updates = {u.param: u for u in roles.updates}
    optimize_blocks, grad_to_block, grad_to_queue, sparse = [], [], [], []
    mine = [s for s in slices if s.endpoint == endpoint]
    for s in mine:
        block_id, queue_block = b.optimize_block(s, updates[s.param])
        optimize_blocks.append(block_id)
        grad_to_block.append(f"{s.grad}:{block_id}")
        if queue_block is not None:
            grad_to_queue.append(f"{s.grad}:{queue_block}")
        if s.sparse:
            sparse.append(f"{s.grad}:{s.name}")
    attrs = {
        "endpoint": endpoint,
        "pserver_id": pserver_id,
        "Fanin": trainers,
        "optimize_blocks": optimize_blocks,
        "grad_to_block_id": grad_to_block,
        "sparse_grad_to_param": sparse,
        "distributed_tables": [s.name for s in mine if s.distributed],
        "distributed_mode": MODE_NUMBERS[config.mode],
        "lr_decay_block_id": lr_block_id,
        "grad_to_queue_block_id": grad_to_queue,
        "staleness": config.staleness,
        "checkpoint_dir": config.checkpoint_dir,
        "checkpoint_every_steps": config.checkpoint_every_steps,
        "checkpoint_every_seconds": float(config.checkpoint_every_seconds),
        "checkpoint_keep": config.checkpoint_keep,
        "checkpoint_base_every": config.checkpoint_base_every,
        "checkpoint_vars": list(b.origins),
        "checkpoint_origins": [origin for origin, _ in b.origins.values()],
        "checkpoint_offsets": [s.offset if s is not None else -1 for _, s in b.origins.values()],
        "checkpoint_origin_rows": [_rows(program, origin) for origin, _ in b.origins.values()],
    }
    append_role_op(
        b.global_block, "listen_and_serv", {"X": [s.grad for s in mine]}, {}, attrs, role=OpRole.RPC
    )
    placements = [
        Placement(origin, name, endpoint, s.offset if s else None, s.rows if s else None)
        for name, (origin, s) in b.origins.items()
    ]
    return b.program, _startup(startup, b), placements


def _startup(startup: Program, b: _PserverBuilder) -> Program:
    """The initializers of this pserver's persistable variables, cut to their slices."""
    out = Program()
    out.random_seed = startup.random_seed
    block = out.global_block()
    origin_startup = startup.global_block()
    for name, (origin, s) in b.origins.items():
        var = b.global_block.var(name)
        init = next((op for op in reversed(origin_startup.ops) if origin in op.output_arg_names), None)
        if init is None:
            raise UnsupportedError(
                f"pserver variable {name!r}: the startup program has no op initializing {origin!r}"
            )
        if any(n != EMPTY_VAR_NAME for n in init.input_arg_names):
            raise UnsupportedError(
                f"pserver variable {name!r}: its initializer {init.type!r} reads other variables; "
                "only self-contained initializers (fill_constant, uniform_random, ...) can be cut into slices"
            )
        block.create_var(name, shape=var.shape, dtype=var.dtype, type=var.type, persistable=True)
        attrs = init.all_attrs()
        shard = next((t for t in b.slices if t.name == name and t.hashed), None)
        if shard is not None:
            # Same seed on every shard: an id's initial row must not depend on where it lives.
            attrs |= {"shard": shard.block_id, "shards": len([t for t in b.slices if t.param == shard.param])}
        elif s is not None and attrs.get("seed"):
            attrs["seed"] += s.block_id  # distinct but reproducible streams per slice
        if "shape" in attrs:
            attrs["shape"] = list(var.shape)
        outputs = {slot: [name if n == origin else n for n in names] for slot, names in init.outputs.items()}
        append_role_op(
            block,
            init.type,
            {},
            outputs,
            attrs,
            role=OpRole(attrs.pop("op_role", 0)),
            role_var=attrs.pop(OP_ROLE_VAR_ATTR, []),
        )
    return out


def _rows(program: Program, name: str) -> int:
    """How many rows the original variable has (-1 for a scalar or an unknown shape)."""
    shape = program.global_block().var(name).shape
    return shape[0] if shape and shape[0] >= 0 else -1

"""The trainer's programs: the original minus what moved to the pservers,
plus the communication ops.

Each step: the gradient of each parameter is cut into its slices
(split_byref, or split_selected_rows for sparse gradients: only touched
rows travel), one send ships every slice to the pservers owning them, and
after send_barrier (sync mode) one recv pulls every parameter slice, which
are concatenated back. One send and one recv per step, not one per
variable: each is a single message per pserver, so a step costs a few
network round trips whatever the number of parameters. The trainer's
startup program receives the initial parameters the same way, so every
trainer starts from the pservers' values.

Distributed tables (fluidps.transpiler.tables), hashed ones included, are neither
received nor initialized: their lookups become distributed_lookup_table ops, which prefetch
the batch's rows, and their gradient ops distributed_lookup_table_grad, which
need no table; the table's variable is not in the trainer's programs at all.
"""

from __future__ import annotations

from collections.abc import Collection

from fluidps.ir.program import Block, Program
from fluidps.ir.types import EMPTY_VAR_NAME, OP_ROLE_VAR_ATTR, OpRole, VarType
from fluidps.ops.optimizers import SUMS_REPEATED_ROWS
from fluidps.ops.roles import append_role_op
from fluidps.transpiler.analysis import ParamUpdate, ProgramRoles, role
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.plan import Slice
from fluidps.transpiler.tables import HASHED_LOOKUP, LOOKUPS


def build_trainer_program(
    program: Program,
    roles: ProgramRoles,
    slices: list[Slice],
    config: DistributeTranspilerConfig,
    trainer_id: int,
    endpoints: tuple[str, ...],
    tables: Collection[str] = (),
) -> Program:
    trainer = program.clone()
    block = trainer.global_block()
    moved = roles.pserver_ops
    block.ops = [op for i, op in enumerate(block.ops) if i not in moved]
    optimizers = {u.param: program.global_block().ops[u.ops[-1]].type for u in roles.updates}
    for table in tables:
        _prefetch(block, table, [s for s in slices if s.param == table], trainer_id, optimizers[table])
        block.remove_var(table)
    _drop_unused_vars(block)
    placed = _send_positions(block, roles, slices, config)
    # (Inserted from the back, so that the positions found stay valid and the sends at one
    # position end up in their order.)
    for (position, *_), update in sorted(placed, key=lambda p: p[0], reverse=True):
        mine = [s for s in slices if s.param == update.param]
        sent = _split_gradient(block, update.grad, mine, position)
        attrs = {
            "epmap": [s.endpoint for _, s in sent],
            "send_varnames": [s.grad for _, s in sent],
            "trainer_id": trainer_id,
            "sync_mode": config.mode == "sync",
            "send_interval": config.send_interval,
            "bucket_bytes": config.send_bucket_bytes,
        }
        if config.communicator:
            attrs |= {
                "use_communicator": True,
                "merge_mode": _merge_mode(config, program.global_block().ops[update.ops[-1]].type),
                "max_merge_var_num": config.communicator_max_merge_var_num,
                "send_queue_size": config.communicator_send_queue_size,
            }
        split_ops = 1 if len(mine) > 1 else 0
        send = {"X": [name for name, _ in sent]}
        append_role_op(block, "send", send, {}, attrs, role=OpRole.RPC, index=position + split_ops)
    if config.mode == "sync":
        append_role_op(
            block,
            "send_barrier",
            {},
            {},
            {"endpoints": list(endpoints), "trainer_id": trainer_id},
            role=OpRole.RPC,
        )
    receive_parameters(block, roles, slices, config, trainer_id, endpoints, background=config.communicator)
    return trainer


def build_trainer_startup(
    startup: Program,
    trainer: Program,
    roles: ProgramRoles,
    slices: list[Slice],
    config: DistributeTranspilerConfig,
    trainer_id: int,
    endpoints: tuple[str, ...],
) -> Program:
    """The original startup, without initializers of what the pservers own, then
    receive the parameters from them."""
    out = startup.clone()
    block = out.global_block()
    remote = {u.param for u in roles.updates}
    needed = {
        n for op in trainer.global_block().ops for n in op.input_arg_names + op.output_arg_names
    } - remote
    block.ops = [op for op in block.ops if set(op.output_arg_names) & needed]
    tables = {s.param for s in slices if s.distributed}
    for table in tables & set(block.vars):
        block.remove_var(table)
    _drop_unused_vars(block, keep=remote - tables)
    for param in sorted(remote - tables, key=[u.param for u in roles.updates].index):
        if param not in block.vars:
            var = trainer.global_block().var(param)
            block.create_var(param, shape=var.shape, dtype=var.dtype, persistable=True)
    receive_parameters(block, roles, slices, config, trainer_id, endpoints)
    return out


def receive_parameters(
    block: Block,
    roles: ProgramRoles,
    slices: list[Slice],
    config: DistributeTranspilerConfig,
    trainer_id: int,
    endpoints: tuple[str, ...],
    background: bool = False,
) -> None:
    """recv every parameter's slices, fetch_barrier (sync), concat the slices. In the
    `background`: by the communicator (the trainer program's; a startup program pulls the
    current values, waiting for them)."""
    sync = config.mode == "sync"
    attrs = {"trainer_id": trainer_id, "sync_mode": sync, "recv_interval": config.recv_interval}
    if background:
        attrs["use_communicator"] = True
    if config.mode == "ssp":
        attrs["staleness"] = config.staleness
    received = [
        s for update in roles.updates for s in slices if s.param == update.param and not s.distributed
    ]
    if received:
        names = [_declare_slice(block, s.param, s) for s in received]
        attrs |= {"epmap": [s.endpoint for s in received], "recv_varnames": [s.name for s in received]}
        append_role_op(block, "recv", {}, {"Out": names}, attrs, role=OpRole.RPC)
    if sync:
        append_role_op(
            block,
            "fetch_barrier",
            {},
            {},
            {"endpoints": list(endpoints), "trainer_id": trainer_id},
            role=OpRole.RPC,
        )
    for update in roles.updates:
        mine = [s for s in slices if s.param == update.param]
        if len(mine) > 1 and not mine[0].distributed:
            append_role_op(
                block,
                "concat",
                {"X": [s.name for s in mine]},
                {"Out": update.param},
                {"axis": 0},
                role=OpRole.Dist,
            )


def _prefetch(block: Block, table: str, blocks: list[Slice], trainer_id: int, optimizer: str) -> None:
    """Replace the lookups of `table` and their gradient ops by ops that need no table."""
    hashed = blocks[0].hashed
    attrs = {
        # A hashed table's rules sum repeated rows first (fluidps.ops.sparse_table), as
        # these optimizer ops do.
        "sum_repeated_rows": hashed or optimizer in SUMS_REPEATED_ROWS,
        "table_name": table,
        "table_names": [s.name for s in blocks],
        "endpoints": [s.endpoint for s in blocks],
        "height_sections": [] if hashed else [s.rows for s in blocks],
        "trainer_id": trainer_id,
        "sharding": "id_hash" if hashed else "row_blocks",
    }
    # The lookups of `table` and their grad ops (each replaced where it is: indices hold).
    mine = [
        (index, op)
        for index, op in enumerate(block.ops)
        if op.type.removesuffix("_grad") in (*LOOKUPS, HASHED_LOOKUP) and op.input("W") == [table]
    ]
    # Where rows are summed, each lookup hands its grad op the batch's ids, found once
    # (UniqueIds, UniqueIndex); not where two lookups read the same Ids (whose would they be?).
    ids_of = [tuple(op.input("Ids")) for _, op in mine if not op.type.endswith("_grad")]
    uniques = {
        ids: (f"{ids[0]}@{table}@UNIQUE_IDS", f"{ids[0]}@{table}@UNIQUE_INDEX")
        for ids in ids_of
        if attrs["sum_repeated_rows"] and ids_of.count(ids) == 1
    }
    for names in uniques.values():
        for name in names:
            block.create_var(name, shape=(-1,), dtype=VarType.INT64)
    for index, op in mine:
        forward = op.type.removesuffix("_grad")
        version = "lookup_table" if forward == HASHED_LOOKUP else forward
        own = attrs | {"padding_idx": op.attr("padding_idx"), "lookup_table_version": version}
        unique = uniques.get(tuple(op.input("Ids")))
        found = {"UniqueIds": [unique[0]], "UniqueIndex": [unique[1]]} if unique else {}
        if op.type == forward:
            inputs, outputs = {"Ids": op.input("Ids")}, {"Outputs": op.output("Out")} | found
        else:
            inputs = {"Ids": op.input("Ids"), "Outputs@GRAD": op.input("Out@GRAD")} | found
            outputs = {"W@GRAD": op.output("W@GRAD")}
        block.remove_op(index)
        append_role_op(
            block,
            "distributed_lookup_table" + op.type.removeprefix(forward),
            inputs,
            outputs,
            own,
            role=OpRole(role(op)),
            role_var=op.attr(OP_ROLE_VAR_ATTR) if op.has_attr(OP_ROLE_VAR_ATTR) else [],
            index=index,
        )


def _send_positions(
    block: Block, roles: ProgramRoles, slices: list[Slice], config: DistributeTranspilerConfig
) -> list[tuple[tuple[int, int, int], ParamUpdate]]:
    """Where each gradient's send goes: (position, then an order among the sends there).

    A send that may fill its pserver's bucket (send_bucket_bytes) goes right after the
    last op that writes its gradient: in backward order, so that its message travels
    while the gradients of the layers below are still being computed. A send that cannot
    fill one only holds its gradient for a later message; it goes just before the next
    send to its pservers that may (a gradient of unknown size, a SelectedRows, may), or
    at the end of backward, so that sends do not cut backward into pieces that the
    compiler runs apart. The messages are the same. A communicator sends each gradient
    on its own: with one, every send stays where its gradient is done."""
    written = sorted((_after_last_write(block, u.grad), i) for i, u in enumerate(roles.updates))
    position = {i: (at, 1, seq) for seq, (at, i) in enumerate(written)}
    if config.communicator or config.send_bucket_bytes == 0:
        return [(position[i], u) for i, u in enumerate(roles.updates)]
    held: dict[str, int] = {}  # bytes held per pserver by the sends in `waiting`
    waiting: dict[int, set[str]] = {}  # sends that fill no bucket -> their pservers
    for at, i in written:
        mine = [s for s in slices if s.param == roles.updates[i].param]
        filled = set()  # the pservers whose buckets this send may fill (and so send)
        for s in mine:
            size = _known_bytes(block, roles.updates[i].grad, s)
            held[s.endpoint] = held.get(s.endpoint, 0) + (size or 0)
            if size is None or held[s.endpoint] >= config.send_bucket_bytes:
                filled.add(s.endpoint)
        if not filled:
            waiting[i] = {s.endpoint for s in mine}
            continue
        for j in [j for j, theirs in waiting.items() if theirs & filled]:
            position[j] = (at, 0, position[j][2])  # just before this send: on its message
            del waiting[j]
        held.update(dict.fromkeys(filled, 0))
    for j in waiting:
        position[j] = (len(block.ops), 0, position[j][2])
    return [(position[i], u) for i, u in enumerate(roles.updates)]


def _known_bytes(block: Block, grad: str, s: Slice) -> int | None:
    """The bytes of slice `s` of gradient `grad`, or None where they depend on the batch
    (a SelectedRows: as many rows as the batch looks up)."""
    if s.sparse or s.hashed or block.var(grad).type == VarType.SELECTED_ROWS:
        return None
    return s.nbytes


def _merge_mode(config: DistributeTranspilerConfig, optimizer: str) -> str:
    """How the communicator merges the gradients of a parameter `optimizer` updates."""
    if config.communicator_merge != "auto":
        return config.communicator_merge
    return "sum" if optimizer == "sgd" else "mean"


def _after_last_write(block: Block, name: str) -> int:
    """The position just after the last op of `block` that writes `name` (0: none does)."""
    writers = [i for i, op in enumerate(block.ops) if name in op.output_arg_names]
    return writers[-1] + 1 if writers else 0


def _split_gradient(block: Block, grad: str, mine: list[Slice], index: int) -> list[tuple[str, Slice]]:
    """Cut `grad` into the slices `mine` with an op inserted at `index` (nothing to cut for a
    whole parameter); returns (local variable, slice) pairs for the send."""
    if len(mine) == 1:
        return [(grad, mine[0])]
    var = block.var(grad)
    for s in mine:
        kind = VarType.SELECTED_ROWS if s.sparse else VarType.LOD_TENSOR
        block.create_var(s.grad, shape=(s.rows, *var.shape[1:]), dtype=var.dtype, type=kind)
    names = [s.grad for s in mine]
    sections = [s.rows for s in mine]
    if mine[0].hashed:
        split, attrs = "shard_selected_rows", {"table_name": mine[0].param}
    elif var.type == VarType.SELECTED_ROWS:
        split, attrs = "split_selected_rows", {"height_sections": sections}
    else:
        split, attrs = "split_byref", {"sections": sections}
    append_role_op(block, split, {"X": grad}, {"Out": names}, attrs, role=OpRole.Dist, index=index)
    return list(zip(names, mine, strict=True))


def _declare_slice(block: Block, param: str, s: Slice) -> str:
    if s.name != param and s.name not in block.vars:
        block.create_var(s.name, shape=s.shape, dtype=s.dtype)
    return s.name


def _drop_unused_vars(block: Block, keep: set[str] | frozenset[str] = frozenset()) -> None:
    """Forget variables no remaining op mentions (optimizer state, learning
    rates, temporaries of moved ops); data variables and `keep` stay."""
    used = {n for op in block.ops for n in op.input_arg_names + op.output_arg_names if n != EMPTY_VAR_NAME}
    for name in list(block.vars):
        var = block.vars[name]
        if name not in used and name not in keep and not var.need_check_feed and not var.is_parameter:
            del block.vars[name]

"""Programs as graphs: a networkx view for analysis and Graphviz DOT for people.

Op nodes and variable nodes alternate: an edge var -> op is a read (labelled
with the slot), op -> var a write. Sub-blocks are DOT clusters, joined to the
op that owns them by a dashed edge; a variable only one sub-block's ops use is drawn
in that block's cluster. In a pipeline program (ops with an op_device), each op is
filled with its stage's colour, and a legend names the colours; given a
parameter-server plan's groups, each op is filled with its pserver's instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import networkx as nx

from fluidps.errors import Error
from fluidps.ir.devices import parse_device
from fluidps.ir.program import Block, Program
from fluidps.ir.types import EMPTY_VAR_NAME, OP_DEVICE_ATTR, AttrType, dtype_name

# A stage's fill: strong enough to tell from the pale fills of ops without a stage
# (yellow) and of parameters (blue), and from one another.
STAGE_COLOURS = ("#f6b26b", "#93c47d", "#b4a7d6", "#76a5af", "#ea9999", "#c27ba0", "#a2c4c9", "#ffd966")
_OP_FILL = "#fff2cc"


def op_node(block: Block, index: int) -> str:
    return f"op:{block.idx}:{index}"


def var_node(block: Block, name: str) -> str:
    """The node of `name` as seen from `block`: in the block that declares it."""
    var = block.find_var(name)
    return f"var:{var.block.idx if var is not None else block.idx}:{name}"


def to_networkx(program: Program, block_idx: int | None = None) -> nx.MultiDiGraph:
    """The dataflow graph of one block, or of every block when `block_idx` is None."""
    graph = nx.MultiDiGraph()
    blocks = program.blocks if block_idx is None else [program.block(block_idx)]
    for block in blocks:
        for i, op in enumerate(block.ops):
            node = op_node(block, i)
            graph.add_node(node, kind="op", type=op.type, block=block.idx, index=i, stage=_stage(op))
            for edges, is_input in ((op.inputs, True), (op.outputs, False)):
                for slot, names in edges.items():
                    for name in names:
                        if name == EMPTY_VAR_NAME:
                            continue
                        vnode = var_node(block, name)
                        _add_var(graph, vnode, block, name)
                        if is_input:
                            graph.add_edge(vnode, node, slot=slot)
                        else:
                            graph.add_edge(node, vnode, slot=slot)
            for name in op.attr_names:
                attr_type = op.attr_type(name)
                if attr_type in (AttrType.BLOCK, AttrType.BLOCKS):
                    value = op.attr(name)
                    graph.nodes[node].setdefault("sub_blocks", []).extend(
                        value if isinstance(value, list) else [value]
                    )
    return graph


def _stage(op) -> int | None:
    """The pipeline stage op_device names (None: none, or a device no stage reads from)."""
    if not op.has_attr(OP_DEVICE_ATTR):
        return None
    try:
        return parse_device(op.attr(OP_DEVICE_ATTR))
    except Error:
        return None


def _add_var(graph: nx.MultiDiGraph, node: str, block: Block, name: str) -> None:
    if node in graph:
        return
    var = block.find_var(name)
    graph.add_node(
        node,
        kind="var",
        name=name,
        block=int(node.split(":")[1]),
        declared=var is not None,
        parameter=bool(var is not None and var.is_parameter),
        persistable=bool(var is not None and var.persistable),
        shape=None if var is None or var.shape is None else list(var.shape),
        dtype=None if var is None else (dtype_name(var.dtype) if var.is_tensor else var.type.name.lower()),
    )


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@dataclass(frozen=True)
class OpGroups:
    """Where ops run, for colouring: (block, op index) -> group, each group's name in
    the legend (`names[g]`), and the name of the ops in no group (`rest`). A pipeline's
    groups are its stages (`stage_groups`); a parameter-server job's, its pservers
    (fluidps.transpiler.plan.pserver_groups)."""

    of_op: Mapping[tuple[int, int], int]
    names: Sequence[str]
    rest: str
    title: str


def stage_groups(program: Program) -> OpGroups | None:
    """Ops by pipeline stage (op_device), or None when no op has a stage."""
    of_op = {
        (block.idx, i): s
        for block in program.blocks
        for i, op in enumerate(block.ops)
        if (s := _stage(op)) is not None
    }
    if not of_op:
        return None
    return OpGroups(of_op, [f"stage {s}" for s in range(max(of_op.values()) + 1)], "no stage", "stages")


def to_dot(program: Program, block_idx: int | None = None, groups: OpGroups | None = None) -> str:
    """Graphviz DOT text: ops as boxes, variables as ellipses, parameters filled,
    other persistable variables doubled, each block a cluster. Ops are filled with
    their group's colour (`groups`; by default their pipeline stage's), with a legend."""
    groups = groups if groups is not None else stage_groups(program)
    graph = to_networkx(program, block_idx)
    for _, data in graph.nodes(data=True):
        if data["kind"] == "op":
            data["group"] = groups.of_op.get((data["block"], data["index"])) if groups else None
    by_block: dict[int, list[str]] = {}
    for node, data in graph.nodes(data=True):
        by_block.setdefault(_drawn_in(graph, node, data), []).append(node)
    # Blocks side by side (a pserver's optimize blocks) read best as rows, one block a row.
    direction = "LR" if len(by_block) > 1 else "TB"
    lines = [
        "digraph program {",
        f"  rankdir={direction}; compound=true;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8, color="#555555"];',
    ]
    for idx in sorted(by_block):
        lines.append(f"  subgraph cluster_{idx} {{")
        parent = program.block(idx).parent_idx
        title = f"block {idx}" + (f" (parent {parent})" if parent >= 0 else "")
        lines.append(f'    label={_quote(title)}; style="rounded"; color="#999999";')
        for node in by_block[idx]:
            lines.append(f"    {_quote(node)} [{_node_style(graph.nodes[node])}];")
        lines.append("  }")
    used = sorted({d["group"] for _, d in graph.nodes(data=True) if d.get("group") is not None})
    if used:  # which colour is which group, in order
        lines.append(
            f'  subgraph cluster_legend {{\n    label={_quote(groups.title)}; style="rounded"; color="#999999";'
        )
        keys = [(f"legend:{g}", _colour(g), groups.names[g]) for g in used]
        if any(d["kind"] == "op" and d.get("group") is None for _, d in graph.nodes(data=True)):
            keys.append(("legend:none", _OP_FILL, groups.rest))
        for node, fill, label in keys:
            lines.append(
                f'    "{node}" [shape=box, style="rounded,filled", fillcolor="{fill}", label={_quote(label)}];'
            )
        lines.append("    " + " -> ".join(f'"{node}"' for node, _, _ in keys) + " [style=invis];")
        lines.append("  }")
    for src, dst, data in graph.edges(data=True):
        lines.append(f"  {_quote(src)} -> {_quote(dst)} [label={_quote(data['slot'])}];")
    for node, data in graph.nodes(data=True):
        for sub in data.get("sub_blocks", []):
            anchor = next(iter(by_block.get(sub, [])), None)
            if anchor is not None:
                lines.append(
                    f'  {_quote(node)} -> {_quote(anchor)} [style=dashed, color="#3366cc", '
                    f"lhead=cluster_{sub}, label={_quote(f'block {sub}')}];"
                )
    lines.append("}")
    return "\n".join(lines) + "\n"


def _drawn_in(graph: nx.MultiDiGraph, node: str, data: dict) -> int:
    """The cluster a node is drawn in: its block, except a variable that only ops of one
    other block use (a pserver's parameter, moments and per-trainer gradients, declared
    in block 0 for its optimize block), which is drawn with them, so that each optimize
    block reads as one picture instead of every variable lining up in block 0."""
    if data["kind"] == "op":
        return data["block"]
    users = {graph.nodes[n]["block"] for n in (*graph.predecessors(node), *graph.successors(node))}
    return users.pop() if len(users) == 1 else data["block"]


def _node_style(data: dict) -> str:
    if data["kind"] == "op":
        fill = _OP_FILL if data.get("group") is None else _colour(data["group"])
        return f'shape=box, style="rounded,filled", fillcolor="{fill}", label={_quote(data["type"])}'
    shape = "" if data["shape"] is None else str(data["shape"])
    label = _quote(f"{data['name']}\n{shape} {data['dtype'] or ''}".rstrip())
    if data["parameter"]:
        return f'shape=ellipse, style="filled,bold", fillcolor="#cfe2f3", label={label}'
    if data["persistable"]:
        return f"shape=ellipse, peripheries=2, label={label}"
    if not data["declared"]:
        return f'shape=ellipse, style=dashed, color="#cc0000", label={label}'
    return f"shape=ellipse, label={label}"


def _colour(group: int) -> str:
    return STAGE_COLOURS[group % len(STAGE_COLOURS)]

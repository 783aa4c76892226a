"""Graph export: the networkx view and DOT clusters for sub-blocks."""

from __future__ import annotations

import networkx as nx

import fluidps
from fluidps.ir.graph import to_dot, to_networkx
from fluidps.ir.types import AttrType
from helpers import build_mlp


def test_networkx_graph_is_the_dataflow():
    main, _, loss = build_mlp()
    graph = to_networkx(main)
    ops = [n for n, d in graph.nodes(data=True) if d["kind"] == "op"]
    assert len(ops) == len(main.global_block().ops)
    assert nx.is_directed_acyclic_graph(graph)
    # Everything flows from the input x to the loss.
    assert nx.has_path(graph, "var:0:x", f"var:0:{loss.name}")
    assert graph.nodes["var:0:fc_0.w_0"]["parameter"] is True
    assert {d["slot"] for _, _, d in graph.in_edges("op:0:0", data=True)} == {"X", "Y"}


def test_sub_blocks_become_clusters_linked_to_their_op():
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("x", shape=[1], dtype="float32")
    sub = program.create_block()
    sub.create_var("y", shape=[1], dtype="float32")
    fluidps.op_registry.append_op(sub, "relu", {"X": "x"}, {"Out": "y"})
    program.rollback()
    # fluidps does not define conditional_block: only a raw op can stand for it.
    block._append_op_unchecked(
        "conditional_block", {"Input": "x"}, {}, {"sub_block": sub}, {"sub_block": AttrType.BLOCK}
    )
    graph = to_networkx(program)
    assert graph.nodes["op:0:0"]["sub_blocks"] == [1]
    # x is declared in block 0 even where block 1 reads it.
    assert graph.has_edge("var:0:x", "op:1:0")
    text = to_dot(program)
    assert "subgraph cluster_1" in text and 'label="block 1 (parent 0)"' in text
    assert "lhead=cluster_1" in text
    only = to_dot(program, block_idx=1)
    assert "cluster_1" in only and '"op:0:0"' not in only


def test_inspect_text_shows_sub_block_references():
    from fluidps.ir.printer import program_to_text

    program = fluidps.Program()
    sub = program.create_block()
    program.rollback()
    program.global_block()._append_op_unchecked("while", attrs={"sub_block": sub, "blocks": [sub]})
    text = program_to_text(program)
    assert "block 1 (parent: 0): 0 variables, 0 ops" in text
    assert "sub_block=block 1" in text and "blocks=blocks [1]" in text


def test_a_pservers_optimize_blocks_are_drawn_each_with_its_own_variables():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = fluidps.layers.data("x", [8])
        loss = fluidps.layers.mean(fluidps.layers.fc(x, 4))
        fluidps.optimizer.Adam(0.01).minimize(loss)
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(min_block_size=8))
    t.transpile(0, main, "127.0.0.1:6174", trainers=2, startup_program=startup)
    pserver, _ = t.get_pserver_programs("127.0.0.1:6174")
    text = to_dot(pserver)
    assert "rankdir=LR" in text  # blocks side by side read as rows
    clusters = text.split("  subgraph cluster_")[1:]
    drawn = {int(c.split(" ", 1)[0]): c.split("\n  }", 1)[0] for c in clusters}
    # A parameter only its optimize block's adam uses is drawn in that block, declared in block 0.
    graph = to_networkx(pserver)
    adam = next(n for n, d in graph.nodes(data=True) if d.get("type") == "adam")
    param = next(src for src, _, slot in graph.in_edges(adam, data="slot") if slot == "Param")
    (user,) = {graph.nodes[n]["block"] for n in (*graph.successors(param), *graph.predecessors(param))}
    assert user > 0 and param.startswith("var:0:")
    assert f'"{param}"' in drawn[user] and f'"{param}"' not in drawn[0]
    # A merged gradient, which listen_and_serv and its optimize block both read, stays in block 0.
    merged = f"var:0:{pserver.global_block().ops[0].input('X')[0]}"
    assert f'"{merged}"' in drawn[0]
    assert "rankdir=TB" in to_dot(main)

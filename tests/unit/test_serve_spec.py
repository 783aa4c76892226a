"""ServeSpec: a listen_and_serv op's attributes, read once into a frozen value and checked
against each other and the program, with errors that name the attribute."""

from __future__ import annotations

import dataclasses

import pytest
from transpiler_models import mlp, sparse_model, transpile

from fluidps.errors import ProgramError
from fluidps.executor.ps.serve_spec import ServeSpec

ENDPOINT = "127.0.0.1:6170"


def serve_op(mode="sync", trainers=2, model=mlp, **config):
    main, startup = model()
    t, _ = transpile(main, startup, mode, pservers=ENDPOINT, trainers=trainers, **config)
    (op,) = t.get_pserver_program(ENDPOINT).global_block().ops
    return op


def test_a_sync_pservers_spec_holds_what_its_op_says():
    op = serve_op(checkpoint_dir="/tmp/ckpt", checkpoint_every_steps=5)
    spec = ServeSpec.of(op)
    assert (spec.endpoint, spec.pserver_id, spec.mode, spec.trainers) == (ENDPOINT, 0, "sync", 2)
    assert spec.name == f"pserver 0 ({ENDPOINT})"
    assert dict(spec.grad_blocks) == {
        e.split(":")[0]: int(e.split(":")[1]) for e in op.attr("grad_to_block_id")
    }
    assert list(spec.grad_blocks.values()) == sorted(spec.grad_blocks.values())
    assert dict(spec.queue_blocks) == {} and spec.lr_block is None and spec.tables == frozenset()
    # Each trainer's gradient lands in a copy of its own, which the optimize block sums.
    assert all(spec.copies[g] == (f"{g}.trainer_0", f"{g}.trainer_1") for g in spec.grad_blocks)
    assert spec.checkpoints.directory == "/tmp/ckpt" and spec.checkpoints.every_steps == 5
    assert set(spec.checkpoints.placements) == set(op.attr("checkpoint_vars"))


def test_the_spec_is_frozen():
    spec = ServeSpec.of(serve_op())
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.trainers = 3
    with pytest.raises(TypeError):
        spec.grad_blocks["x"] = 1


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_async_pserver_has_a_receive_block_per_gradient_and_one_trainer_no_copies(mode):
    spec = ServeSpec.of(serve_op(mode, trainers=1, staleness=2 if mode == "ssp" else 0))
    assert spec.mode == mode and set(spec.queue_blocks) == set(spec.grad_blocks)
    assert all(spec.copies[g] == (g,) for g in spec.grad_blocks)
    assert spec.staleness == (2 if mode == "ssp" else 0)


def test_distributed_tables_and_the_learning_rate_block_are_read():
    spec = ServeSpec.of(serve_op(model=sparse_model, trainers=1, distributed_table_min_rows=1000))
    assert len(spec.tables) == 1
    decayed = ServeSpec.of(serve_op(model=lambda: mlp(decay=True)))
    assert decayed.lr_block is not None and decayed.lr_block not in decayed.grad_blocks.values()


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("grad_to_block_id", ["fc_0.w_0@GRAD"], "'fc_0.w_0@GRAD' is not 'gradient:block'"),
        ("grad_to_block_id", ["w@GRAD:1", "w@GRAD:2"], "gradient 'w@GRAD' is listed twice"),
        ("grad_to_block_id", ["w@GRAD:99"], "'w@GRAD:99': no sub-block 99"),
        ("grad_to_block_id", ["w@GRAD:0"], "'w@GRAD:0': no sub-block 0"),
        ("grad_to_queue_block_id", ["nobody@GRAD:1"], "gradients \\['nobody@GRAD'\\] have no optimize block"),
        ("lr_decay_block_id", 99, "99 is not a block"),
        ("distributed_tables", ["no_such_table"], "\\['no_such_table'\\] are not persistable variables here"),
        ("checkpoint_origins", ["a"], "1 entries for [0-9]+ checkpoint_vars"),
        ("distributed_mode", 3, "3 is not a known mode"),
        ("Fanin", 0, "0 trainers"),
    ],
)
def test_a_malformed_attribute_is_refused_naming_it_and_the_pserver(attribute, value, message):
    op = serve_op()
    op.set_attr(attribute, value)
    pattern = rf"pserver 0 \(127\.0\.0\.1:6170\): listen_and_serv's attribute {attribute}: .*{message}"
    with pytest.raises(ProgramError, match=pattern):
        ServeSpec.of(op)


def test_an_async_gradient_without_a_receive_block_is_refused():
    op = serve_op("async", trainers=1)
    op.set_attr("grad_to_queue_block_id", op.attr("grad_to_queue_block_id")[1:])
    with pytest.raises(ProgramError, match=r"grad_to_queue_block_id: async: gradients .* have no block"):
        ServeSpec.of(op)

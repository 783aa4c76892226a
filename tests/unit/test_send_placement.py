"""Where the trainer program's send ops go: a send that may fill its pserver's bucket
right after its gradient is done, one that cannot just before the next send that may,
or after backward (which then stays one compiled segment)."""

from __future__ import annotations

from transpiler_models import BACKWARD_MLP, mlp, ops, sparse_model, transpile

RPC_TAIL = ["send_barrier", "recv", "fetch_barrier", "concat"]


def test_sends_that_fill_no_bucket_go_at_the_end_of_backward():
    """The MLP's gradients (75 KiB) fill no 1 MiB bucket: they all ride on the step's last
    message whatever their sends' places, so the sends go together after backward, which
    stays in one piece (one compiled segment)."""
    main, startup = mlp()
    t, _plan = transpile(main, startup, "sync")
    trainer = ops(t.get_trainer_program())
    start = trainer.index("fill_constant")
    sends = ["send", "send", "send", "split_byref", "send"]  # fc_1.b, fc_1.w, fc_0.b, fc_0.w cut in two
    assert trainer[start:] == BACKWARD_MLP + sends + RPC_TAIL
    block = t.get_trainer_program().global_block().ops
    sent = [op.input("X") for op in block if op.type == "send"]
    assert sent == [  # in the order backward computed them
        ["fc_1.b_0@GRAD"], ["fc_1.w_0@GRAD"], ["fc_0.b_0@GRAD"], ["fc_0.w_0@GRAD.block0", "fc_0.w_0@GRAD.block1"],
    ]  # fmt: skip


def test_a_send_that_may_fill_its_bucket_stays_where_its_gradient_is_done():
    """With 8 KiB buckets, fc_1.w (256 x 10 floats, 10 KiB) fills one: its send stays right
    after its mul_grad, while fc_0's gradients are still to come. fc_1.b fills none: it
    goes with the next send to its pserver that does, fc_0.w's (each of its blocks, 32 KiB,
    fills one), just before it, as fc_0.b does."""
    main, startup = mlp()
    t, _plan = transpile(main, startup, "sync", send_bucket_bytes=8 * 1024)
    block = t.get_trainer_program().global_block().ops
    start = [op.type for op in block].index("fill_constant")
    assert [(op.type, op.input("X") if op.type == "send" else None) for op in block[start:]] == [
        *((name, None) for name in BACKWARD_MLP[:5]),
        ("send", ["fc_1.w_0@GRAD"]),
        *((name, None) for name in BACKWARD_MLP[5:]),
        ("send", ["fc_1.b_0@GRAD"]),
        ("send", ["fc_0.b_0@GRAD"]),
        ("split_byref", None),
        ("send", ["fc_0.w_0@GRAD.block0", "fc_0.w_0@GRAD.block1"]),
        *((name, None) for name in RPC_TAIL),
    ]


def test_a_sparse_gradients_send_may_fill_its_bucket():
    """A SelectedRows gradient's size depends on the batch: its send stays where the
    gradient is done, and the sends to its pserver that fill no bucket go just before it."""
    main, startup = sparse_model(vocab=100)  # 100 x 8: 3 KiB, but a SelectedRows gradient
    t, _plan = transpile(main, startup, "sync")
    block = t.get_trainer_program().global_block().ops
    start = [op.type for op in block].index("lookup_table_v2_grad")
    assert (
        [(op.type, op.input("X") if op.type == "send" else None) for op in block[start:]]
        == [
            ("lookup_table_v2_grad", None),
            ("send", ["fc_0.b_0@GRAD"]),  # fc_0.b on the embedding's pserver, fc_0.w on the other
            ("send", ["fc_0.w_0@GRAD"]),
            ("send", ["embedding_0.w_0@GRAD"]),
            *((name, None) for name in RPC_TAIL[:-1]),
        ]
    )

"""Optimizers, weight decay, clipping and learning-rate schedules: the ops and
variables they create (Fluid's names and roles) and the numbers they compute."""

from __future__ import annotations

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer
from fluidps.ir.types import OpRole


def f32(value: float) -> float:
    """Hyper-parameters travel as float32 attributes (and a float32 learning rate)."""
    return float(np.float32(value))


def _model(opt_factory, dtype="float32", **fc_kwargs):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [3], dtype=dtype)
        loss = layers.mean(layers.square(layers.fc(x, 2, **fc_kwargs)))
        opt = opt_factory()
        ops, params_grads = opt.minimize(loss)
    return main, startup, loss, opt, ops, params_grads


def test_adam_creates_fluid_named_state_in_startup():
    main, startup, _, opt, ops, _params_grads = _model(lambda: optimizer.Adam(0.01))
    assert [op.type for op in ops] == ["adam", "adam"]
    names = set(startup.global_block().vars)
    for p in ("fc_0.w_0", "fc_0.b_0"):
        assert {f"{p}_moment1_0", f"{p}_moment2_0", f"{p}_beta1_pow_acc_0", f"{p}_beta2_pow_acc_0"} <= names
    assert "learning_rate_0" in names and main.global_block().var("learning_rate_0").persistable
    for op in ops:
        assert op.attr("op_role") == int(OpRole.Optimize)
        assert op.attr("op_role_var") == [op.input("Param")[0], op.input("Grad")[0]]
        assert op.output("ParamOut") == op.input("Param")
    assert opt.learning_rate_var.name == "learning_rate_0"
    fluidps.verify(main)
    fluidps.verify(startup)


def _train(main, startup, loss, steps=3, dtype=np.float32):
    exe = fluidps.Executor()
    exe.run(startup)
    rng = np.random.default_rng(0)
    before = {p.name: exe.scope[p.name].copy() for p in main.all_parameters()}
    grads_seen = []
    grad_names = [p.name + "@GRAD" for p in main.all_parameters()]
    for _ in range(steps):
        feed = {"x": rng.normal(size=(4, 3)).astype(dtype)}
        grads_seen.append(dict(zip(grad_names, exe.run(main, feed=feed, fetch_list=grad_names), strict=True)))
    return exe, before, grads_seen


@pytest.mark.parametrize("name", ["sgd", "momentum", "nesterov", "adagrad", "adam", "ftrl"])
def test_updates_follow_fluids_formulas(name):
    factories = {
        "sgd": lambda: optimizer.SGD(0.1),
        "momentum": lambda: optimizer.Momentum(0.1, 0.9),
        "nesterov": lambda: optimizer.Momentum(0.1, 0.9, use_nesterov=True),
        "adagrad": lambda: optimizer.Adagrad(0.1, epsilon=1e-6),
        "adam": lambda: optimizer.Adam(0.1, beta1=0.9, beta2=0.999, epsilon=1e-8),
        "ftrl": lambda: optimizer.Ftrl(0.1, l1=0.01, l2=0.1),
    }
    main, startup, loss, *_ = _model(factories[name], dtype="float64")
    exe, before, grads = _train(main, startup, loss, dtype=np.float64)
    lr, mu, b1, b2, eps = f32(0.1), f32(0.9), f32(0.9), f32(0.999), f32(1e-8)
    for p in ("fc_0.w_0", "fc_0.b_0"):
        value, state = before[p].copy(), {}
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[p + "@GRAD"]
            if name == "sgd":
                value -= lr * g
            elif name in ("momentum", "nesterov"):
                v = state["v"] = mu * state.get("v", 0) + g
                value -= lr * (g + mu * v) if name == "nesterov" else lr * v
            elif name == "adagrad":
                m = state["m"] = state.get("m", 0) + g * g
                value -= lr * g / (np.sqrt(m) + f32(1e-6))
            elif name == "ftrl":  # Paddle's ftrl op, lr_power -0.5
                l1, l2, squared = f32(0.01), f32(0.1), state.get("n", 0)
                new = squared + g * g
                linear = state["z"] = state.get("z", 0) + g - (np.sqrt(new) - np.sqrt(squared)) / lr * value
                state["n"] = new
                value = np.where(
                    np.abs(linear) > l1, (l1 * np.sign(linear) - linear) / (np.sqrt(new) / lr + 2 * l2), 0
                )
            else:
                m1 = state["m1"] = b1 * state.get("m1", 0) + (1 - b1) * g
                m2 = state["m2"] = b2 * state.get("m2", 0) + (1 - b2) * g * g
                b1_pow = np.prod([f32(0.9)] * t)
                b2_pow = np.prod([f32(0.999)] * t)
                lr_t = lr * np.sqrt(1 - b2_pow) / (1 - b1_pow)
                value -= lr_t * m1 / (np.sqrt(m2) + eps * np.sqrt(1 - b2_pow))
        np.testing.assert_allclose(exe.scope[p], value, rtol=1e-6, err_msg=f"{name} {p}")


def test_l2_decay_adds_coeff_times_param():
    main, startup, loss, *_ = _model(
        lambda: optimizer.SGD(0.1, regularization=fluidps.L2Decay(0.5)), dtype="float64"
    )
    ops = main.global_block().ops
    decayed = [op for op in ops if op.type == "sum" and op.attr("op_role") == int(OpRole.Optimize)]
    assert len(decayed) == 2
    exe, before, grads = _train(main, startup, loss, steps=1, dtype=np.float64)
    for p in ("fc_0.w_0", "fc_0.b_0"):
        expected = before[p] - f32(0.1) * (grads[0][p + "@GRAD"] + 0.5 * before[p])
        np.testing.assert_allclose(exe.scope[p], expected, rtol=1e-10)


def test_param_attr_regularizer_and_learning_rate_win():
    attr = fluidps.ParamAttr(regularizer=fluidps.L2Decay(0.0), learning_rate=0.5)
    main, startup, loss, *_ = _model(
        lambda: optimizer.SGD(0.1, regularization=fluidps.L2Decay(1.0)), dtype="float64", param_attr=attr
    )
    exe, before, grads = _train(main, startup, loss, steps=1, dtype=np.float64)
    w = "fc_0.w_0"
    np.testing.assert_allclose(exe.scope[w], before[w] - f32(0.1) * 0.5 * grads[0][w + "@GRAD"], rtol=1e-10)
    b = "fc_0.b_0"
    np.testing.assert_allclose(
        exe.scope[b], before[b] - f32(0.1) * (grads[0][b + "@GRAD"] + before[b]), rtol=1e-10
    )


def test_global_norm_clipping():
    clip = fluidps.GradientClipByGlobalNorm(0.01)
    main, startup, loss, *_ = _model(lambda: optimizer.SGD(1.0, grad_clip=clip), dtype="float64")
    exe, before, grads = _train(main, startup, loss, steps=1, dtype=np.float64)
    g = grads[0]
    norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
    assert norm > 0.01  # so clipping is active
    for p in ("fc_0.w_0", "fc_0.b_0"):
        np.testing.assert_allclose(exe.scope[p], before[p] - g[p + "@GRAD"] * f32(0.01) / norm, rtol=1e-8)


def test_clipping_sparse_gradients_uses_the_merged_rows():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [3], dtype="int64")
        loss = layers.reduce_sum(layers.embedding_v2(ids, [5, 2], is_sparse=True))
        optimizer.SGD(1.0, grad_clip=fluidps.GradientClipByGlobalNorm(1.0)).minimize(loss)
    exe = fluidps.Executor()
    exe.run(startup)
    w0 = exe.scope["embedding_0.w_0"].copy()
    exe.run(main, feed={"ids": np.array([[1, 1, 3]])})
    # Dense gradient: row 1 gets 2 (looked up twice), row 3 gets 1: norm sqrt(4+4+1+1).
    dense = np.zeros((5, 2))
    dense[1], dense[3] = 2.0, 1.0
    # float32 values near 0 (the initial rows are random): compare to float32 rounding
    np.testing.assert_allclose(exe.scope["embedding_0.w_0"], w0 - dense / np.sqrt(10.0), rtol=1e-6, atol=1e-7)


def test_l2_decay_refuses_sparse_gradients():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [3], dtype="int64")
        loss = layers.mean(layers.embedding_v2(ids, [5, 2], is_sparse=True))
        with pytest.raises(fluidps.UnsupportedError, match="gradient is sparse"):
            optimizer.SGD(0.1, regularization=fluidps.L2Decay(0.1)).minimize(loss)


def _lr_values(make_lr, steps):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [2])
        loss = layers.mean(layers.fc(x, 1))
        lr = make_lr()
        optimizer.SGD(lr).minimize(loss)
    roles = {
        op.type: op.attr("op_role")
        for op in main.global_block().ops
        if op.attr("op_role") == int(OpRole.LRSched)
    }
    assert "increment" in roles and main.global_block().ops[0].type == "increment"
    exe = fluidps.Executor()
    exe.run(startup)
    return [
        float(exe.run(main, feed={"x": np.ones((1, 2), np.float32)}, fetch_list=[lr])[0][0])
        for _ in range(steps)
    ]


def test_exponential_decay():
    values = _lr_values(lambda: layers.exponential_decay(0.1, 2, 0.5), 5)
    np.testing.assert_allclose(values, [0.1 * 0.5 ** (t / 2) for t in range(5)], rtol=1e-6)
    stair = _lr_values(lambda: layers.exponential_decay(0.1, 2, 0.5, staircase=True), 5)
    np.testing.assert_allclose(stair, [0.1, 0.1, 0.05, 0.05, 0.025], rtol=1e-6)


def test_piecewise_decay():
    values = _lr_values(lambda: layers.piecewise_decay([2, 4], [1.0, 0.5, 0.1]), 6)
    np.testing.assert_allclose(values, [1.0, 1.0, 0.5, 0.5, 0.1, 0.1], rtol=1e-6)
    with (
        pytest.raises(fluidps.BuilderError, match=r"len\(values\) == len\(boundaries\) \+ 1"),
        fluidps.program_guard(fluidps.Program(), fluidps.Program()),
    ):
        layers.piecewise_decay([2], [1.0])


def test_minimize_needs_a_startup_program():
    main = fluidps.Program()
    with fluidps.program_guard(main):
        x = layers.data("x", [2])
        y = layers.mean(x)
    with pytest.raises(fluidps.BuilderError):
        optimizer.SGD(0.1).minimize(y)


def _two_layers():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [3])
        loss = layers.mean(layers.square(layers.fc(layers.fc(x, 4, act="tanh"), 2)))
    return main, startup, loss


def _updated(main, startup, loss, *startups):
    """Which parameters one training step changes."""
    exe = fluidps.Executor()
    for program in (startup, *startups):
        exe.run(program)
    before = {p.name: exe.scope[p.name].copy() for p in main.all_parameters()}
    exe.run(main, feed={"x": np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)})
    return {name for name, value in before.items() if not np.array_equal(exe.scope[name], value)}


def _updated_params(main, op_type):
    return [op.input("Param")[0] for op in main.global_block().ops if op.type == op_type]


ALL_PARAMS = ["fc_0.w_0", "fc_0.b_0", "fc_1.w_0", "fc_1.b_0"]


def test_minimize_parameter_list_updates_only_the_listed_parameters():
    main, startup, loss = _two_layers()
    listed = [main.global_block().var("fc_1.w_0"), "fc_0.b_0"]  # a Parameter and a name
    with fluidps.program_guard(main, startup):
        ops, params_grads = optimizer.Adam(0.1).minimize(loss, parameter_list=listed)
    assert sorted(p.name for p, _ in params_grads) == ["fc_0.b_0", "fc_1.w_0"]
    assert sorted(_updated_params(main, "adam")) == sorted(op.input("Param")[0] for op in ops)
    assert sorted(_updated_params(main, "adam")) == ["fc_0.b_0", "fc_1.w_0"]
    moments = {n for n in startup.global_block().vars if "_moment1_" in n}
    assert moments == {"fc_0.b_0_moment1_0", "fc_1.w_0_moment1_0"}
    assert _updated(main, startup, loss) == {"fc_0.b_0", "fc_1.w_0"}
    _, other_startup, other_loss = _two_layers()
    with pytest.raises(fluidps.BuilderError, match="'x' in parameter_list is not a parameter"):
        optimizer.SGD(0.1).minimize(other_loss, other_startup, parameter_list=["x"])


@pytest.mark.parametrize("excluded", [["fc_0.w_0"], ["fc_1.w_0", "fc_1.b_0"]])
def test_minimize_no_grad_set_parameters_get_no_update(excluded):
    main, startup, loss = _two_layers()
    no_grad = {main.global_block().var(excluded[0]), *excluded[1:]}  # Variables and names
    with fluidps.program_guard(main, startup):
        _, params_grads = optimizer.Momentum(0.1, 0.9).minimize(loss, no_grad_set=no_grad)
    kept = [p for p in ALL_PARAMS if p not in excluded]
    assert [p.name for p, _ in params_grads] == kept
    assert _updated_params(main, "momentum") == kept
    assert not any(f"{p}@GRAD" in main.global_block().vars for p in excluded)
    assert {n for n in startup.global_block().vars if "_velocity_" in n} == {f"{p}_velocity_0" for p in kept}
    assert _updated(main, startup, loss) == set(kept)


def test_minimize_explicit_startup_program_receives_the_state():
    main, startup, loss = _two_layers()
    state = fluidps.Program()
    # Outside any program_guard: minimize works from the loss and the startup it is given.
    ops, _ = optimizer.Adam(0.1).minimize(loss, startup_program=state)
    assert len(ops) == len(ALL_PARAMS)
    created = {op.output("Out")[0] for op in state.global_block().ops}
    expected = {"learning_rate_0"} | {
        f"{p}_{acc}_0" for p in ALL_PARAMS for acc in ("moment1", "moment2", "beta1_pow_acc", "beta2_pow_acc")
    }
    assert created == expected
    assert all(op.type == "fill_constant" for op in state.global_block().ops)
    assert all(state.global_block().var(n).persistable for n in expected)
    # The model's own startup program only initializes the parameters.
    assert {op.output("Out")[0] for op in startup.global_block().ops} == set(ALL_PARAMS)
    assert _updated(main, startup, loss, state) == set(ALL_PARAMS)
    exe = fluidps.Executor()
    exe.run(startup)  # without `state`, the optimizer's variables are missing
    with pytest.raises(fluidps.ExecutionError, match="is not initialized in the scope"):
        exe.run(main, feed={"x": np.ones((1, 3), np.float32)})

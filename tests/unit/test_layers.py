"""The builder API: what each layer appends, to which program, with which names."""

from __future__ import annotations

import math

import numpy as np
import pytest

import fluidps
from fluidps import initializer, layers
from fluidps.ir.types import VarType


def ops_of(program):
    return [op.type for op in program.global_block().ops]


@pytest.fixture
def programs():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        yield main, startup


def test_data_prepends_the_batch_dimension(programs):
    x = layers.data("x", [3, 4])
    y = layers.data("y", [-1, 5])
    z = layers.data("z", [7], append_batch_size=False, dtype="int64")
    assert (x.shape, y.shape, z.shape) == ((-1, 3, 4), (-1, 5), (7,))
    assert x.stop_gradient and x.need_check_feed and not x.persistable
    assert z.dtype == VarType.INT64
    with pytest.raises(fluidps.BuilderError, match="already exists"):
        layers.data("x", [1])


def test_fc_lowers_to_mul_add_activation(programs):
    main, startup = programs
    x = layers.data("x", [2, 3])
    out = layers.fc(x, 4, num_flatten_dims=2, act="tanh")
    assert ops_of(main) == ["mul", "elementwise_add", "tanh"]
    mul, add, _ = main.global_block().ops
    assert mul.attr("x_num_col_dims") == 2 and add.attr("axis") == 2
    assert main.global_block().var("fc_0.w_0").shape == (3, 4)
    assert main.global_block().var("fc_0.b_0").shape == (4,)
    assert out.name == "fc_0.tmp_2" and out.shape == (-1, 2, 4)
    # Xavier for the weight, zeros for the bias, in the startup program.
    init_w, init_b = startup.global_block().ops
    limit = math.sqrt(6.0 / (3 + 4))
    assert init_w.type == "uniform_random" and init_w.attr("max") == pytest.approx(limit)
    assert init_w.attr("min") == pytest.approx(-limit) and init_w.attr("shape") == [3, 4]
    assert init_b.type == "fill_constant" and init_b.attr("value") == 0.0


def test_fc_with_several_inputs_sums_products(programs):
    main, _ = programs
    a, b = layers.data("a", [3]), layers.data("b", [5])
    layers.fc([a, b], 2, bias_attr=False)
    assert ops_of(main) == ["mul", "mul", "sum"]
    assert [p.shape for p in main.all_parameters()] == [(3, 2), (5, 2)]


def test_param_attr_names_initializes_and_shares(programs):
    main, startup = programs
    x = layers.data("x", [4])
    attr = fluidps.ParamAttr(name="shared_w", initializer=initializer.Constant(0.5), learning_rate=0.1)
    layers.fc(x, 4, param_attr=attr, bias_attr=False)
    layers.fc(x, 4, param_attr=attr, bias_attr=False)
    params = main.all_parameters()
    assert [p.name for p in params] == ["shared_w"]
    assert params[0].learning_rate == pytest.approx(0.1)
    assert ops_of(startup) == ["fill_constant"]
    assert ops_of(main) == ["mul", "mul"]
    with pytest.raises(fluidps.BuilderError, match="cannot reuse"):
        layers.fc(x, 3, param_attr="shared_w")


def test_frozen_parameters_stop_gradients(programs):
    main, _ = programs
    layers.fc(layers.data("x", [4]), 2, param_attr=fluidps.ParamAttr(trainable=False))
    w = main.global_block().var("fc_0.w_0")
    assert not w.trainable and w.stop_gradient


def test_embedding_variants_and_padding_idx(programs):
    main, _ = programs
    ids1 = layers.data("ids1", [1], dtype="int64")
    ids = layers.data("ids", [26], dtype="int64")
    e1 = layers.embedding(ids1, [100, 8], is_sparse=True, padding_idx=-1)
    e2 = layers.embedding_v2(ids, [100, 8])
    assert e1.shape == (-1, 8) and e2.shape == (-1, 26, 8)
    v1, v2 = main.global_block().ops
    assert (v1.type, v1.attr("is_sparse"), v1.attr("padding_idx")) == ("lookup_table", True, 99)
    assert (v2.type, v2.attr("is_sparse"), v2.attr("padding_idx")) == ("lookup_table_v2", False, -1)
    with pytest.raises(fluidps.BuilderError, match="must be int64"):
        layers.embedding(layers.data("f", [1]), [10, 2])
    with pytest.raises(fluidps.BuilderError, match="outside the 100-row table"):
        layers.embedding(ids1, [100, 8], padding_idx=100)


def test_conv2d_pool2d_and_default_filter_init(programs):
    main, startup = programs
    img = layers.data("img", [3, 32, 32])
    c = layers.conv2d(img, 8, 5, padding=2, act="relu")
    p = layers.pool2d(c, 2, "avg", 2)
    g = layers.pool2d(c, global_pooling=True)
    assert c.shape == (-1, 8, 32, 32) and p.shape == (-1, 8, 16, 16) and g.shape == (-1, 8, 1, 1)
    assert ops_of(main) == ["conv2d", "elementwise_add", "relu", "pool2d", "pool2d"]
    init = startup.global_block().ops[0]
    assert init.type == "gaussian_random"
    assert init.attr("std") == pytest.approx(math.sqrt(2.0 / (5 * 5 * 3)))
    same = layers.conv2d(img, 2, 3, padding="SAME", stride=2)
    assert same.shape == (-1, 2, 16, 16)
    with pytest.raises(fluidps.BuilderError, match="pool_size"):
        layers.pool2d(c)
    with pytest.raises(fluidps.BuilderError, match="'max' or 'avg'"):
        layers.pool2d(c, 2, "min")


def test_loss_and_metric_layers(programs):
    main, _ = programs
    x = layers.data("x", [10])
    label = layers.data("label", [1], dtype="int64")
    loss, softmax = layers.softmax_with_cross_entropy(x, label, return_softmax=True)
    assert (softmax.name, loss.name) == (
        "softmax_with_cross_entropy_0.tmp_0",
        "softmax_with_cross_entropy_0.tmp_1",
    )
    acc = layers.accuracy(softmax, label, k=5)
    assert ops_of(main)[-2:] == ["top_k", "accuracy"]
    assert acc.dtype == VarType.FP32 and acc.shape == ()
    ce = layers.cross_entropy(softmax, label)
    assert ce.shape == (-1, 1)


def test_tensor_layers(programs):
    _, startup = programs
    x = layers.data("x", [4, 6])
    assert layers.reshape(x, [0, 24]).shape == (-1, 24)
    assert layers.transpose(x, [0, 2, 1]).shape == (-1, 6, 4)
    assert layers.flatten(x).shape == (-1, 24)
    parts = layers.split(x, [1, 2, -1], dim=2)
    assert [p.shape for p in parts] == [(-1, 4, 1), (-1, 4, 2), (-1, 4, 3)]
    assert layers.concat(parts, axis=2).shape == (-1, 4, 6)
    assert layers.cast(x, "float64").dtype == VarType.FP64
    assert layers.reduce_sum(x).shape == () and layers.reduce_mean(x, dim=1, keep_dim=True).shape == (
        -1,
        1,
        6,
    )
    lr = layers.create_global_var([1], 0.01, "float32", persistable=True, name="learning_rate_0")
    assert lr.persistable and "learning_rate_0" in startup.global_block().vars
    assert startup.global_block().ops[-1].attr("value") == pytest.approx(0.01)
    assert layers.fill_constant([2], "int64", 3).dtype == VarType.INT64


def test_dropout_mask_and_attributes(programs):
    main, _ = programs
    out = layers.dropout(layers.data("x", [3]), 0.25, seed=9)
    op = main.global_block().ops[-1]
    assert op.attr("fix_seed") and op.attr("seed") == 9 and op.attr("dropout_prob") == 0.25
    mask = main.global_block().var(op.output("Mask")[0])
    assert mask.dtype == VarType.UINT8 and mask.stop_gradient and out.shape == (-1, 3)


def test_layer_errors_name_the_layer(programs):
    x = layers.data("x", [3])
    with pytest.raises(fluidps.BuilderError, match="fc: input 0 must be a Variable"):
        layers.fc("x", 2)
    with pytest.raises(fluidps.BuilderError, match="unknown activation 'gelu'"):
        layers.fc(x, 2, act="gelu")
    with pytest.raises(fluidps.BuilderError, match="must be float"):
        layers.fc(layers.data("i", [3], dtype="int64"), 2)
    with pytest.raises(fluidps.ShapeError, match="elementwise_add"):
        layers.elementwise_add(x, layers.data("y", [4]))
    other = fluidps.Program()
    with fluidps.program_guard(other, fluidps.Program()):
        stranger = layers.data("s", [3])
    with pytest.raises(fluidps.BuilderError, match="belongs to another program"):
        layers.relu(stranger)


def test_random_seed_reaches_initializers():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 42
    with fluidps.program_guard(main, startup):
        layers.fc(layers.data("x", [3]), 2)
    assert startup.global_block().ops[0].attr("seed") == 42


def _initialized(init, shape=(200, 100), random_seed=0):
    """The values `init` gives a float32 parameter of `shape`, by running the startup program."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = random_seed
    with fluidps.program_guard(main, startup):
        layers.create_parameter(list(shape), "float32", attr=fluidps.ParamAttr(name="w", initializer=init))
    exe = fluidps.Executor()
    exe.run(startup)
    value = exe.scope["w"]
    assert value.shape == shape and value.dtype == np.float32
    return value.astype(np.float64)


def test_uniform_initializer_fills_its_range():
    w = _initialized(initializer.Uniform(-0.5, 2.0, seed=7))
    assert w.min() >= -0.5 and w.max() < 2.0
    assert w.min() < -0.49 and w.max() > 1.99  # the whole range, not a corner of it
    # 20,000 draws: the mean's standard error is 2.5 / sqrt(12 * 20000) ~ 0.005.
    assert abs(w.mean() - 0.75) < 0.03 and abs(w.std() - 2.5 / math.sqrt(12)) < 0.02
    np.testing.assert_array_equal(_initialized(initializer.Uniform(-0.5, 2.0, seed=7)), w)
    assert not np.array_equal(_initialized(initializer.Uniform(-0.5, 2.0, seed=8)), w)


def test_normal_initializer_moments():
    w = _initialized(initializer.Normal(3.0, 0.5, seed=11))
    assert abs(w.mean() - 3.0) < 0.02 and abs(w.std() - 0.5) < 0.015
    assert abs(np.mean(np.abs(w - 3.0) < 0.5) - 0.6827) < 0.02  # one standard deviation: 68%
    np.testing.assert_array_equal(_initialized(initializer.Normal(3.0, 0.5, seed=11)), w)
    # seed=0 takes the startup program's random_seed.
    np.testing.assert_array_equal(_initialized(initializer.Normal(3.0, 0.5), random_seed=11), w)


@pytest.mark.parametrize(("shape", "fan_sum"), [((200, 100), 300), ((16, 8, 5, 5), 8 * 25 + 16 * 25)])
def test_xavier_normal_initializer_moments(shape, fan_sum):
    w = _initialized(initializer.Xavier(uniform=False, seed=3), shape)
    std = math.sqrt(2.0 / fan_sum)
    assert abs(w.mean()) < 0.15 * std and abs(w.std() / std - 1) < 0.05
    # Gaussian, not uniform: about 8% lie beyond the uniform variant's limit sqrt(6 / fan_sum).
    beyond = np.mean(np.abs(w) > math.sqrt(6.0 / fan_sum))
    assert 0.05 < beyond < 0.12
    uniform = _initialized(initializer.Xavier(seed=3), shape)
    assert np.abs(uniform).max() <= math.sqrt(6.0 / fan_sum)

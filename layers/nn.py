"""Layers with parameters: fc, embedding, sparse_embedding, conv2d; and pool2d, dropout."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fluidps.errors import BuilderError
from fluidps.initializer import Normal, Uniform
from fluidps.ir.types import VarType, to_numpy_dtype, to_vartype
from fluidps.ir.variable import Variable
from fluidps.layers.helper import LayerHelper, float_dtype
from fluidps.ops import REGISTRY
from fluidps.ops.sparse_table import TableSettings
from fluidps.param_attr import ParamAttr


def fc(
    input: Variable | Sequence[Variable],
    size: int,
    num_flatten_dims: int = 1,
    param_attr: Any = None,
    bias_attr: Any = None,
    act: str | None = None,
    name: str | None = None,
) -> Variable:
    """A fully connected layer, lowered as Fluid does: `mul` per input (summed if
    several), `elementwise_add` of the bias, then the activation. Each input is
    flattened to a matrix at `num_flatten_dims`."""
    helper = LayerHelper("fc", name)
    inputs = list(input) if isinstance(input, (list, tuple)) else [input]
    attrs = param_attr if isinstance(param_attr, (list, tuple)) else [param_attr] * len(inputs)
    if len(attrs) != len(inputs):
        raise BuilderError(f"fc: {len(inputs)} inputs but {len(attrs)} param_attrs")
    products = []
    for i, (x, attr) in enumerate(zip(inputs, attrs, strict=True)):
        helper.check_variable(x, f"input {i}")
        dtype = float_dtype(helper, x)
        if not 0 < num_flatten_dims < len(x.shape):
            raise BuilderError(
                f"fc: num_flatten_dims={num_flatten_dims} must be in [1, {len(x.shape)}) for {x!r}"
            )
        in_features = math.prod(x.shape[num_flatten_dims:])
        if in_features <= 0:
            raise BuilderError(f"fc: input {x!r} must have known dimensions after num_flatten_dims")
        w = helper.create_parameter(ParamAttr.to_attr(attr), [in_features, size], dtype)
        out = helper.create_tmp(dtype)
        helper.append_op("mul", {"X": x, "Y": w}, {"Out": out}, {"x_num_col_dims": num_flatten_dims})
        products.append(out)
    pre_bias = products[0]
    if len(products) > 1:
        pre_bias = helper.create_tmp(products[0].dtype)
        helper.append_op("sum", {"X": products}, {"Out": pre_bias})
    pre_act = helper.append_bias(pre_bias, bias_attr, dim_start=num_flatten_dims)
    return helper.append_activation(pre_act, act)


def _embedding(
    op_type: str, input, size, is_sparse, is_distributed, padding_idx, param_attr, dtype
) -> Variable:
    helper = LayerHelper("embedding")
    helper.check_variable(input, "input")
    if input.dtype not in (VarType.INT64, VarType.INT32):
        raise BuilderError(f"embedding: ids ({input.name}) must be int64, got {input.dtype.name}")
    if len(size) != 2:
        raise BuilderError(f"embedding: size must be [rows, width], got {size}")
    rows = int(size[0])
    if padding_idx is None:
        padding_idx = -1
    elif not -rows <= padding_idx < rows:
        raise BuilderError(f"embedding: padding_idx {padding_idx} is outside the {rows}-row table")
    elif padding_idx < 0:
        padding_idx += rows
    w = helper.create_parameter(ParamAttr.to_attr(param_attr), size, dtype)
    out = helper.create_tmp(w.dtype)
    attrs = {"is_sparse": is_sparse, "is_distributed": is_distributed, "padding_idx": padding_idx}
    helper.append_op(op_type, {"Ids": input, "W": w}, {"Out": out}, attrs)
    return out


def embedding(
    input: Variable,
    size: Sequence[int],
    is_sparse: bool = False,
    is_distributed: bool = False,
    padding_idx: int | None = None,
    param_attr: Any = None,
    dtype: Any = "float32",
) -> Variable:
    """Fluid 1.x `layers.embedding` (op lookup_table): ids shaped [..., 1] give
    [..., width]. `is_sparse` makes the table's gradient a SelectedRows of the
    looked-up rows; `padding_idx` rows read zeros and get no gradient."""
    return _embedding("lookup_table", input, size, is_sparse, is_distributed, padding_idx, param_attr, dtype)


def embedding_v2(
    input: Variable,
    size: Sequence[int],
    is_sparse: bool = False,
    is_distributed: bool = False,
    padding_idx: int | None = None,
    param_attr: Any = None,
    dtype: Any = "float32",
) -> Variable:
    """`fluid.embedding` / Paddle 2's embedding (op lookup_table_v2): ids of any
    shape give ids.shape + [width]."""
    return _embedding(
        "lookup_table_v2", input, size, is_sparse, is_distributed, padding_idx, param_attr, dtype
    )


def sparse_embedding(
    input: Variable,
    size: Sequence[int],
    padding_idx: int | None = None,
    param_attr: Any = None,
    dtype: Any = "float32",
    *,
    min_count: int = 1,
    admit_probability: float = 1.0,
    ttl_steps: int = 0,
    score_decay: float = 1.0,
    delete_threshold: float = 0.0,
    shrink_every: int = 0,
    max_rows: int = 0,
    evict_when_full: bool = False,
) -> Variable:
    """An embedding over int64 ids with no vocabulary bound (ids shaped [..., 1], any
    value >= 0: raw feature hashes): a hashed table whose rows are created as ids are
    trained, not declared up front. `size` is [-1, dim] (the rows entry is ignored).

    A new row starts from values that depend only on (seed, id): `param_attr`'s
    initializer, Uniform(low, high, seed) or Normal(loc, scale, seed) (default
    Uniform(-0.01, 0.01); seed 0 takes the startup program's random_seed).
    Admission: a row is created once its id was trained in `min_count` steps, each
    time with probability `admit_probability`; until then lookups read the initial
    values and its gradients are dropped. Eviction, at a shrink every `shrink_every`
    steps: rows not updated for more than `ttl_steps` steps, and rows whose score
    (appearances, times `score_decay` at each shrink) is under `delete_threshold`.
    `max_rows` bounds the table: past it, new rows are refused with an error, or with
    `evict_when_full` the lowest-scored rows make room. The optimizer trains each row
    with its own state (SGD, Adagrad, lazy Adam or Ftrl); weight decay and gradient
    clipping do not apply to hashed tables. Under a DistributeTranspiler the table is
    sharded over every pserver by id; it never exists on the trainers."""
    helper = LayerHelper("sparse_embedding")
    helper.check_variable(input, "input")
    if input.dtype not in (VarType.INT64, VarType.INT32):
        raise BuilderError(f"sparse_embedding: ids ({input.name}) must be int64, got {input.dtype.name}")
    if len(size) != 2 or int(size[1]) < 1:
        raise BuilderError(f"sparse_embedding: size must be [-1, dim] with dim >= 1, got {list(size)}")
    if helper.startup is None:
        raise BuilderError(
            "sparse_embedding creates a table: pass a startup program to program_guard(main, startup)"
        )
    dim = int(size[1])
    attr = ParamAttr.to_attr(param_attr)
    init = attr.initializer or Uniform(-0.01, 0.01)
    if isinstance(init, Uniform):
        kind, a, b = "uniform", init.low, init.high
    elif isinstance(init, Normal):
        kind, a, b = "normal", init.loc, init.scale
    else:
        raise BuilderError(
            f"sparse_embedding: a hashed table's rows start from Uniform or Normal (by id), not {init!r}"
        )
    name = attr.name or helper.main.unique_name(f"{helper.name}.w")
    dtype = to_vartype(dtype)
    settings = TableSettings(
        dim=dim, dtype=np.dtype(to_numpy_dtype(dtype)).name, initializer=kind, init_a=float(a), init_b=float(b),
        seed=int(init.seed or helper.startup.random_seed), min_count=int(min_count),
        admit_probability=float(admit_probability), ttl_steps=int(ttl_steps), score_decay=float(score_decay),
        delete_threshold=float(delete_threshold), shrink_every=int(shrink_every), max_rows=int(max_rows),
        evict_when_full=bool(evict_when_full),
    ).check(name)  # fmt: skip
    if padding_idx is not None and padding_idx < 0:
        raise BuilderError(f"sparse_embedding: padding_idx must be an id >= 0 (or None), got {padding_idx}")
    fields = dict(trainable=attr.trainable, learning_rate=attr.learning_rate, type=VarType.SELECTED_ROWS)
    main_block, startup_block = helper.main.global_block(), helper.startup.global_block()
    if name in main_block.vars or name in startup_block.vars:
        raise BuilderError(
            f"sparse_embedding: {name!r} already exists; hashed tables cannot be shared by name"
        )
    table = startup_block.create_parameter(name, [-1, dim], dtype, **fields)
    attrs = {f: getattr(settings, f) for f in TableSettings.names() if f not in ("shard", "shards")}
    REGISTRY.append_op(startup_block, "hashed_table", outputs={"Out": table}, attrs=attrs)
    w = main_block.create_parameter(name, [-1, dim], dtype, **fields)
    out = helper.create_tmp(w.dtype)
    pad = -1 if padding_idx is None else int(padding_idx)
    helper.append_op("lookup_sparse_table", {"Ids": input, "W": w}, {"Out": out}, {"padding_idx": pad})
    return out


def _pair(value: int | Sequence[int], what: str) -> list[int]:
    if isinstance(value, int):
        return [value, value]
    values = [int(v) for v in value]
    if len(values) != 2:
        raise BuilderError(f"{what} must be an int or a pair, got {value!r}")
    return values


def _padding(padding: int | str | Sequence[int]) -> tuple[list[int], str]:
    if isinstance(padding, str):
        if padding.upper() not in ("SAME", "VALID"):
            raise BuilderError(f"padding must be a number, a list, 'SAME' or 'VALID', got {padding!r}")
        return [0, 0], padding.upper()
    if isinstance(padding, int):
        return [padding, padding], "EXPLICIT"
    values = [int(p) for p in padding]
    if len(values) not in (2, 4):
        raise BuilderError(f"padding must have 2 or 4 values, got {padding!r}")
    return values, "EXPLICIT"


def conv2d(
    input: Variable,
    num_filters: int,
    filter_size: int | Sequence[int],
    stride: int | Sequence[int] = 1,
    padding: int | str | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int | None = None,
    param_attr: Any = None,
    bias_attr: Any = None,
    use_cudnn: bool = True,
    act: str | None = None,
    name: str | None = None,
    data_format: str = "NCHW",
) -> Variable:
    """2-D convolution of an NCHW input, plus a per-filter bias and `act`. The
    filter defaults to Normal(0, sqrt(2 / (kh * kw * channels))), as in Fluid."""
    helper = LayerHelper("conv2d", name)
    helper.check_variable(input, "input")
    dtype = float_dtype(helper, input)
    if data_format != "NCHW":
        raise BuilderError(f"conv2d: only NCHW is supported, got {data_format!r}")
    if len(input.shape) != 4 or input.shape[1] <= 0:
        raise BuilderError(f"conv2d: input must be NCHW with known channels, got {list(input.shape)}")
    channels = input.shape[1]
    groups = groups or 1
    if channels % groups:
        raise BuilderError(f"conv2d: {channels} input channels do not divide into {groups} groups")
    kh, kw = _pair(filter_size, "filter_size")
    paddings, algorithm = _padding(padding)
    std = (2.0 / (kh * kw * channels)) ** 0.5
    w = helper.create_parameter(
        ParamAttr.to_attr(param_attr),
        [num_filters, channels // groups, kh, kw],
        dtype,
        default_initializer=Normal(0.0, std),
    )
    out = helper.create_tmp(dtype)
    attrs = {
        "strides": _pair(stride, "stride"),
        "paddings": paddings,
        "padding_algorithm": algorithm,
        "dilations": _pair(dilation, "dilation"),
        "groups": groups,
        "use_cudnn": use_cudnn,
        "data_format": data_format,
    }
    helper.append_op("conv2d", {"Input": input, "Filter": w}, {"Output": out}, attrs)
    pre_act = helper.append_bias(out, bias_attr, dim_start=1, dim_end=2)
    return helper.append_activation(pre_act, act)


def pool2d(
    input: Variable,
    pool_size: int | Sequence[int] = -1,
    pool_type: str = "max",
    pool_stride: int | Sequence[int] = 1,
    pool_padding: int | str | Sequence[int] = 0,
    global_pooling: bool = False,
    use_cudnn: bool = True,
    ceil_mode: bool = False,
    name: str | None = None,
    exclusive: bool = True,
    data_format: str = "NCHW",
) -> Variable:
    """Max or average pooling over windows of an NCHW input."""
    helper = LayerHelper("pool2d", name)
    helper.check_variable(input, "input")
    if pool_type not in ("max", "avg"):
        raise BuilderError(f"pool2d: pool_type must be 'max' or 'avg', got {pool_type!r}")
    if not global_pooling and pool_size == -1:
        raise BuilderError("pool2d: give pool_size, or global_pooling=True")
    paddings, algorithm = _padding(pool_padding)
    attrs = {
        "pooling_type": pool_type,
        "ksize": _pair(pool_size if pool_size != -1 else 1, "pool_size"),
        "global_pooling": global_pooling,
        "strides": _pair(pool_stride, "pool_stride"),
        "paddings": paddings,
        "padding_algorithm": algorithm,
        "use_cudnn": use_cudnn,
        "ceil_mode": ceil_mode,
        "exclusive": exclusive,
        "data_format": data_format,
    }
    return helper.unary("pool2d", input, attrs)


def dropout(
    x: Variable,
    dropout_prob: float,
    is_test: bool = False,
    seed: int | None = None,
    name: str | None = None,
    dropout_implementation: str = "downgrade_in_infer",
) -> Variable:
    """Zero each element with probability `dropout_prob` while training."""
    helper = LayerHelper("dropout", name)
    helper.check_variable(x, "x")
    out = helper.create_tmp(x.dtype)
    mask = helper.create_tmp(VarType.UINT8, stop_gradient=True)
    attrs = {
        "dropout_prob": float(dropout_prob),
        "is_test": is_test,
        "fix_seed": seed is not None,
        "seed": seed or 0,
        "dropout_implementation": dropout_implementation,
    }
    helper.append_op("dropout", {"X": x}, {"Out": out, "Mask": mask}, attrs)
    return out

"""The program fuzzer: random and mutated programs, run where a crash cannot hurt.

Each program is made from (seed, index) alone, so any one can be made again:
- "seed":   a model built with the layers (an MLP, sparse embeddings, a conv net, layout
            ops; each with its optimizer: sgd, adam, momentum, adagrad; dense and
            SelectedRows gradients) or a Paddle fixture, fed odd batches;
- "mutate": one of those with 1-3 edits made through the IR, past the builder's checks:
            an attribute set to a bad value (huge or negative axis, dims, ksize, strides,
            paddings, dtypes), a declared shape or dtype changed, an input rewired;
- "single": one op of any type with a kernel, its inputs of random shapes and dtypes
            (SelectedRows gradients for optimizers), its attributes random;
- "bytes":  a seed program's ProgramDesc with bytes flipped.
Then: fluidps.check, and runs of the startup and main programs, interpreted, compiled
(compiled segments do run: the block compiles at its second run) or "raw" (the block
runner without verify, so the run-time guard alone stands between values and kernels).
Every outcome must be a clean run or a fluidps.Error.

Programs run in worker processes (`python tests/fuzz_programs.py --worker ...`), one JSON
line each; the parent (`fuzz`) bounds every wait, and a worker that dies by a signal or
hangs is reported with the seed and index of the program it was running, and restarted.
tests/unit/test_fuzz.py runs a seeded subset; `python -m bench.fuzz` the full run.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
PROGRAM_TIMEOUT_S = 120.0  # one program, a cold numba compile included
REPLAYED = 10  # programs before a crash replayed alone to find the one that crashes
MEMORY_LIMIT = 6 << 30  # a worker's address space (numba and LLVM fit in a few hundred MB)
_ATTR_INTS = [-(2**31), -7, -2, -1, 0, 1, 2, 3, 7, 2**31 - 1]
_ATTR_FLOATS = [float("nan"), float("inf"), -1.0, 0.0, 0.5, 1e30]
_ATTR_STRINGS = ["", "bogus", "NHWC", "max", "avg", "SAME", "VALID", "upscale_in_train"]
_DTYPES = ["float32"] * 5 + ["float64", "int64", "int32"]
_SKIP_OPS = {  # ops that take part in jobs, or read the holders the executor fills
    "send", "recv", "send_barrier", "fetch_barrier", "listen_and_serv", "enqueue", "dequeue",
    "distributed_lookup_table", "distributed_lookup_table_grad", "create_dataset_reader", "read",
    "feed", "fetch",
}  # fmt: skip


# -- seed programs --------------------------------------------------------------------------


def _seed_programs() -> list[tuple[str, bytes, bytes, str]]:
    """(name, main, startup, loss) of every seed program, serialized."""
    import fluidps
    from fluidps import layers, optimizer

    def built(name: str, body, opt) -> tuple[str, bytes, bytes, str]:
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 1
        with fluidps.program_guard(main, startup):
            loss = body(layers)
            opt().minimize(loss)
        return name, main.serialize_to_string(), startup.serialize_to_string(), loss.name

    def mlp(L):
        x, y = L.data("x", [6]), L.data("y", [1], dtype="int64")
        h = L.fc(L.fc(x, 5, act="relu"), 4, act="tanh")
        return L.mean(L.softmax_with_cross_entropy(L.fc(h, 3), y))

    def sparse(L):
        ids, y = L.data("ids", [3], dtype="int64"), L.data("y", [1], dtype="int64")
        emb = L.embedding_v2(ids, [20, 4], is_sparse=True)
        return L.mean(L.softmax_with_cross_entropy(L.fc(L.reshape(emb, [-1, 12]), 3), y))

    def conv(L):
        img, y = L.data("img", [1, 6, 6]), L.data("y", [1], dtype="int64")
        c = L.conv2d(img, 2, 3, padding=1, act="relu")
        f = L.flatten(L.pool2d(c, 2, "max", 2))
        return L.mean(L.cross_entropy(L.softmax(L.fc(f, 3)), y))

    def layout(L):
        x, b = L.data("x", [6]), L.create_parameter([2], "float32")
        r = L.transpose(L.reshape(x, [-1, 2, 3]), [0, 2, 1])
        h = L.concat([L.flatten(r), x], axis=1)
        a, c = L.split(h, 2, dim=1)
        h = L.elementwise_mul(L.sums([a, c]), L.sigmoid(L.scale(a, 0.5, bias=1.0)))
        h = L.elementwise_add(L.reshape(h, [-1, 3, 2]), b, axis=2)
        h = L.dropout(L.tanh(L.exp(h)), 0.2)
        h = L.elementwise_div(h, L.sqrt(L.scale(L.square(h), 1.0, bias=1.0)))
        values, _ = L.topk(L.reduce_sum(h, dim=1), 2)
        return L.mean(L.elementwise_sub(values, L.reduce_mean(h, dim=[1, 2], keep_dim=True)))

    seeds = []
    optimizers = [
        lambda: optimizer.SGD(0.1),
        lambda: optimizer.Adam(0.01),
        lambda: optimizer.Adam(0.01, lazy_mode=True),
        lambda: optimizer.Momentum(0.1, 0.9),
        lambda: optimizer.Adagrad(0.1),
    ]
    for k, opt in enumerate(optimizers):
        seeds.append(built(f"mlp/{k}", mlp, opt))
        seeds.append(built(f"sparse/{k}", sparse, opt))
    seeds.append(built("conv/sgd", conv, optimizers[0]))
    seeds.append(built("layout/momentum", layout, optimizers[3]))
    seeds.append(_inference_model(fluidps, HERE / "fixtures" / "paddle" / "lenet_infer" / "model.pdmodel"))
    for name in ("sgd_tanh", "adam_sparse"):
        fixture = HERE / "fixtures" / "paddle" / name
        loss = json.loads((fixture / "summary.json").read_text())["loss"]
        seeds.append(
            (
                f"paddle/{name}",
                (fixture / "main.pb").read_bytes(),
                (fixture / "startup.pb").read_bytes(),
                loss,
            )
        )
    return seeds


def _inference_model(fluidps: Any, path: Path) -> tuple[str, bytes, bytes, str]:
    """Paddle's LeNet saved for inference (feed and fetch ops), with a startup program
    that fills its parameters at random."""
    from fluidps.ir.types import VarType

    main = fluidps.Program.parse_from_string(path.read_bytes())
    startup = fluidps.Program()
    block = startup.global_block()
    for var in main.global_block().vars.values():
        if var.persistable and var.type == VarType.LOD_TENSOR and var.shape:
            block.create_var(var.name, shape=var.shape, dtype=var.dtype, persistable=True)
            attrs = {"shape": list(var.shape), "dtype": int(var.dtype), "seed": 1}
            fluidps.op_registry.append_op(block, "uniform_random", {}, {"Out": var.name}, attrs)
    return "paddle/lenet_infer", path.read_bytes(), startup.serialize_to_string(), ""


# -- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One program to run, and how."""

    kind: str
    mode: str  # interpreted | compiled | raw
    main: Any
    startup: Any
    fetch: list[str]
    feeds: list[dict[str, Any]]  # one per run of main
    scope: dict[str, Any] = field(default_factory=dict)  # values put in the scope first
    edits: list[str] = field(default_factory=list)

    def describe(self) -> str:
        head = f"kind={self.kind} mode={self.mode} edits={self.edits} fetch={self.fetch}"
        feeds = [{n: _shape_of(v) for n, v in feed.items()} for feed in self.feeds]
        return (
            f"{head}\nfeeds={feeds}\nscope={ {n: _shape_of(v) for n, v in self.scope.items()} }\n{self.main}"
        )


def _shape_of(value: Any) -> str:
    return repr(value) if not isinstance(value, np.ndarray) else f"{value.dtype}{list(value.shape)}"


class Maker:
    """Cases from (seed, index); the seed programs are built once per process."""

    def __init__(self) -> None:
        self.seeds = _seed_programs()

    def case(self, seed: int, index: int) -> Case:
        import fluidps

        rng = np.random.default_rng([seed, index])
        kind = rng.choice(["seed", "mutate", "single", "bytes"], p=[0.2, 0.45, 0.3, 0.05])
        mode = str(rng.choice(["interpreted", "compiled", "raw"], p=[0.55, 0.15, 0.3]))
        if kind == "single":
            return _single(rng, mode)
        name, main_bytes, startup_bytes, loss = self.seeds[rng.integers(len(self.seeds))]
        edits = [f"seed {name}"]
        if kind == "bytes":
            data = bytearray(main_bytes)
            for _ in range(rng.integers(1, 6)):
                data[rng.integers(len(data))] = rng.integers(256)
            main_bytes = bytes(data)
            edits.append("bytes flipped")
        main = fluidps.Program.parse_from_string(main_bytes)
        startup = fluidps.Program.parse_from_string(startup_bytes)
        if kind == "mutate":
            for _ in range(rng.integers(1, 4)):
                edits.append(_mutate(rng, main))
        runs = 3 if mode == "compiled" else int(rng.integers(1, 3))
        feeds = [_feed(rng, main.global_block(), odd=kind != "seed" or step > 0) for step in range(runs)]
        return Case(str(kind), mode, main, startup, [loss] if loss else [], feeds, edits=edits)


def _mutate(rng: np.random.Generator, program: Any) -> str:
    """One edit of `program` through the IR (no builder checks); says what it did."""
    from fluidps.ir.types import AttrType, VarType

    block = program.global_block()
    what = rng.choice(["attr", "attr", "shape", "dtype", "rewire"])
    if what in ("shape", "dtype"):
        tensors = [v for v in block.vars.values() if v.type == VarType.LOD_TENSOR and v.shape is not None]
        var = tensors[rng.integers(len(tensors))]
        if what == "dtype":
            var.dtype = VarType[str(rng.choice(["FP32", "FP64", "INT64", "INT32", "BOOL"]))]
            return f"{var.name} dtype -> {var.dtype.name}"
        var.shape = _random_shape(rng, rank=len(var.shape) if rng.random() < 0.6 else None)
        return f"{var.name} shape -> {list(var.shape)}"
    op = block.ops[rng.integers(len(block.ops))]
    if what == "rewire":
        slots = [s for s, names in op.inputs.items() if names]
        if not slots:
            return f"op {op.type}: nothing to rewire"
        slot = slots[rng.integers(len(slots))]
        names = list(block.vars)
        new = names[rng.integers(len(names))]
        op.set_input(slot, [new] * len(op.input(slot)))
        return f"op {op.type} {slot} -> {new}"
    names = [n for n in op.attr_names if not n.startswith("op_")]
    if not names:
        return f"op {op.type}: no attribute"
    name = names[rng.integers(len(names))]
    kind = op.attr_type(name)
    value = _attr_value(rng, kind)
    if value is None:
        return f"op {op.type}: {name} left"
    op.set_attr(name, value, AttrType.LONGS if kind == AttrType.LONGS else kind)
    return f"op {op.type} {name} -> {value!r}"


def _attr_value(rng: np.random.Generator, kind: Any) -> Any:
    from fluidps.ir.types import AttrType

    ints = _ATTR_INTS + ([2**40, -(2**40)] if kind in (AttrType.LONG, AttrType.LONGS) else [])
    if kind in (AttrType.INT, AttrType.LONG):
        return int(rng.choice(ints))
    if kind in (AttrType.INTS, AttrType.LONGS):
        return [
            int(rng.choice(ints)) if rng.random() < 0.5 else int(rng.integers(0, 4))
            for _ in range(rng.integers(0, 5))
        ]
    if kind == AttrType.FLOAT:
        return float(rng.choice(_ATTR_FLOATS))
    if kind == AttrType.BOOLEAN:
        return bool(rng.random() < 0.5)
    if kind == AttrType.STRING:
        return str(rng.choice(_ATTR_STRINGS))
    return None


def _random_shape(rng: np.random.Generator, rank: int | None = None) -> tuple[int, ...]:
    rank = int(rng.integers(0, 5)) if rank is None else rank
    return tuple(
        int(rng.choice([-1, 0, 1, 2, 3, 4, 5], p=[0.2, 0.04, 0.2, 0.2, 0.16, 0.1, 0.1])) for _ in range(rank)
    )


def _value(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, odd: bool) -> np.ndarray:
    if dtype in ("int64", "int32"):
        high = (
            int(rng.choice([2, 3, 4, 20]))
            if not odd or rng.random() < 0.7
            else int(rng.choice([10**6, 2**31 - 1]))
        )
        values = rng.integers(-1 if odd and rng.random() < 0.2 else 0, high, shape)
        return values.astype(dtype)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    values = rng.normal(size=shape)
    if odd and values.size and rng.random() < 0.1:
        values.reshape(-1)[0] = rng.choice([np.inf, -np.inf, np.nan, 0.0])
    return values.astype(dtype)


def _feed(rng: np.random.Generator, block: Any, odd: bool) -> dict[str, np.ndarray]:
    """Values for what `block` reads before it writes (its data): declared shapes with a
    batch for -1 (one batch mostly; with `odd`, sometimes a second one, a wrong dtype,
    or a wrong rank), ids and labels sometimes out of range."""
    from fluidps.ir.types import EMPTY_VAR_NAME, TENSOR_KINDS, to_numpy_dtype

    written: set[str] = set()
    wanted: list[str] = []
    for op in block.ops:
        reads = op.output_arg_names if op.type == "feed" else op.input_arg_names  # (a feed op's column)
        for name in reads:
            var = block.find_var(name)
            if name == EMPTY_VAR_NAME or name in written or var is None or var.persistable:
                continue
            if var.type in TENSOR_KINDS and name not in wanted:
                wanted.append(name)
        written.update(op.output_arg_names)
    batch = int(rng.choice([0, 1, 2, 3, 5], p=[0.05, 0.2, 0.3, 0.3, 0.15]))
    feed = {}
    for name in wanted:
        var = block.find_var(name)
        try:
            dtype = to_numpy_dtype(var.dtype).name if var.dtype is not None else "float32"
        except Exception:
            dtype = "float32"
        if odd and rng.random() < 0.05:
            dtype = str(rng.choice(_DTYPES))
        shape = list(var.shape or ())
        this_batch = batch if not (odd and rng.random() < 0.15) else int(rng.integers(0, 6))
        shape = [this_batch if d < 0 else d for d in shape]
        if odd and rng.random() < 0.03:
            shape = [abs(d) for d in _random_shape(rng)]
        feed[name] = _value(rng, tuple(shape), dtype, odd)
    return feed


def _single(rng: np.random.Generator, mode: str) -> Case:
    """One op of a random type with a kernel: random inputs and attributes. A grad op is
    mostly made from its forward op's: the forward inputs, the outputs they make (as
    inference says) and gradients of those outputs' shapes (sometimes of others)."""
    import fluidps
    from fluidps.ir.opschema import REQUIRED
    from fluidps.ir.types import GRAD_SUFFIX, VarType
    from fluidps.ops import REGISTRY

    types = sorted(t for t in REGISTRY if REGISTRY.has_kernel(t) and t not in _SKIP_OPS)
    op_type = types[rng.integers(len(types))]
    schema = REGISTRY[op_type]
    forward = REGISTRY.get(op_type.removesuffix("_grad")) if op_type.endswith("_grad") else None
    forward = forward if forward is not None and rng.random() < 0.75 else None
    main = fluidps.Program()
    block = main.global_block()
    values: dict[str, Any] = {}
    updates = schema.output_slot("ParamOut") is not None
    inputs = _random_inputs(rng, forward or schema, block, values, updates)
    attrs = {}
    for spec in schema.attrs:
        wanted = not spec.extra and (spec.default is REQUIRED or rng.random() < 0.4)
        if wanted and (value := _attr_value(rng, spec.type)) is not None:
            attrs[spec.name] = value
    outputs = {}
    if forward is not None:  # its outputs, and their gradients, from what the forward op makes
        fwd_outputs = {s.name: [f"{s.name.lower()}_fwd"] for s in forward.outputs if not s.extra}
        fwd = fluidps.Operator(block, forward.type, inputs, fwd_outputs, attrs)
        declared, concrete = _inferred(fwd, block, None), _inferred(fwd, block, values)
        for slot, (name,) in fwd_outputs.items():
            made = concrete.get(name)
            too_big = made is None or made.shape is None or abs(np.prod(made.shape, dtype=float)) > 1e6
            if name not in declared or too_big or rng.random() < 0.1:
                continue
            info, grad = declared[name], name + GRAD_SUFFIX
            block.create_var(name, shape=info.shape, dtype=info.dtype, type=info.type)
            block.create_var(grad, shape=info.shape, dtype=info.dtype, type=info.type)
            dtype, shape = (
                _numpy_name(concrete[name].dtype),
                tuple(abs(d) for d in concrete[name].shape or ()),
            )
            values[name] = _value(rng, shape, dtype, odd=False)
            odd = rng.random() < 0.2
            values[grad] = _value(
                rng, tuple(abs(d) for d in _random_shape(rng)) if odd else shape, dtype, odd=odd
            )
            inputs |= {slot: [name]} if rng.random() < 0.8 else {}
            inputs[slot + GRAD_SUFFIX] = [grad]
        wanted = [s.name for s in forward.inputs if not s.extra and s.name in inputs]
        outputs = {s + GRAD_SUFFIX: [f"{s.lower()}_grad_{k}" for k in range(len(inputs[s]))] for s in wanted}
    else:
        for slot in schema.outputs:
            source = slot.name.removesuffix("Out")
            if slot.extra:
                continue
            in_place = updates and source in inputs and rng.random() < 0.8
            outputs[slot.name] = inputs[source] if in_place else [f"{slot.name.lower()}_out"]
    op = block._append_op_unchecked(op_type, inputs, outputs, attrs)
    made = _inferred(op, block, None)  # outputs declared as inferred, where it can say: verify may pass
    for names in outputs.values():
        for name in (n for n in names if block.find_var(n) is None):
            info = made.get(name)
            known = info is not None and info.shape is not None and info.dtype is not None
            shape, dtype = (info.shape, info.dtype) if known else (_random_shape(rng), VarType.FP32)
            block.create_var(name, shape=shape, dtype=dtype, type=info.type if info else VarType.LOD_TENSOR)
    feed = {n: v for n, v in values.items() if not block.var(n).persistable}
    scope = {n: v for n, v in values.items() if block.var(n).persistable}
    fetch = [n for names in outputs.values() for n in names][:1]
    runs = 3 if mode == "compiled" else 1
    return Case("single", mode, main, fluidps.Program(), fetch, [feed] * runs, scope, [f"op {op_type}"])


def _random_inputs(rng: np.random.Generator, schema: Any, block: Any, values: dict, updates: bool) -> dict:
    """Variables (declared, valued in `values`) for `schema`'s input slots; most share one shape."""
    from fluidps.ir.types import VarType
    from fluidps.ops.selected_rows import SelectedRows

    common = _random_shape(rng)
    inputs = {}
    for slot in schema.inputs:
        if slot.extra or (slot.dispensable and rng.random() < 0.3):
            continue
        names = []
        for k in range(int(rng.integers(1, 4)) if slot.duplicable else 1):
            name, shape = f"{slot.name.lower()}_{k}", common if rng.random() < 0.7 else _random_shape(rng)
            labels = slot.name in ("Ids", "Label", "Indices") and rng.random() < 0.8
            dtype = "int64" if labels else str(rng.choice(_DTYPES))
            sparse = slot.name in ("Grad", "X") and rng.random() < (0.5 if updates else 0.1)
            kind = VarType.SELECTED_ROWS if sparse else VarType.LOD_TENSOR
            block.create_var(
                name, shape=shape, dtype=dtype, type=kind, persistable=updates and slot.name != "Grad"
            )
            concrete = tuple(d if d >= 0 else int(rng.integers(0, 4)) for d in shape)
            values[name] = _value(rng, concrete, dtype, odd=True)
            if sparse:
                height, rows = int(rng.integers(1, 6)), rng.integers(0, 6, int(rng.integers(0, 4)))
                rows = rows % height if rng.random() < 0.9 else rows
                width = concrete[1:] if concrete else ()
                value = _value(rng, (len(rows), *width), dtype, odd=True)
                values[name] = SelectedRows(rows, value, height) if rows.max(initial=0) < height else value
            names.append(name)
        inputs[slot.name] = names
    return inputs


def _inferred(op: Any, block: Any, values: dict | None) -> dict:
    """What `op`'s inference makes of its block's declarations (or of `values`' shapes); {} if it fails."""
    from fluidps.ir.infer import VarInfo
    from fluidps.ops import REGISTRY

    def lookup(name: str) -> Any:
        var = block.find_var(name)
        info = None if var is None else VarInfo.of(var)
        value = None if values is None else values.get(name)
        if info is not None and value is not None and hasattr(value, "shape"):
            shape = value.shape if isinstance(value, np.ndarray) else (value.height, *value.value.shape[1:])
            return VarInfo(name, info.type, info.dtype, tuple(shape))
        return info

    try:
        return REGISTRY.infer(op, lookup)
    except Exception:
        return {}


def _numpy_name(dtype: Any) -> str:
    from fluidps.ir.types import to_numpy_dtype

    try:
        return to_numpy_dtype(dtype).name
    except Exception:
        return "float32"


# -- running one case -------------------------------------------------------------------------


def run_case(case: Case, cache_dir: str) -> tuple[str, str]:
    """(outcome, detail): "clean", a fluidps.Error's class name, "other:<type>", or
    "out-of-bounds" when numba's bounds checks (NUMBA_BOUNDSCHECK=1, as workers run)
    caught a kernel reading or writing past an array, whatever error it became."""
    import fluidps

    try:
        fluidps.check(case.main)
        if case.mode == "raw":
            _run_raw(case)
        else:
            _run_executor(case, cache_dir)
        return "clean", ""
    except fluidps.Error as e:
        if _numba_out_of_bounds(e):
            return "out-of-bounds", "".join(traceback.format_exception(e))[-3000:]
        return type(e).__name__, str(e)[:300]
    except Exception as e:
        return f"other:{type(e).__name__}", traceback.format_exc()[-3000:]


def _numba_out_of_bounds(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, IndexError) and str(error) == "index is out of bounds":  # numba's words
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _run_executor(case: Case, cache_dir: str) -> None:
    import fluidps
    from fluidps.executor.compiler import Compiler, ModuleCache

    compiler: Any = False
    if case.mode == "compiled":
        compiler = Compiler(ModuleCache(Path(cache_dir)), min_ops=1, compile_after=2)
    exe = fluidps.Executor(compile=compiler)
    for name, value in case.scope.items():
        exe.scope[name] = value
    exe.run(case.startup)
    for feed in case.feeds:
        exe.run(case.main, feed=feed, fetch_list=case.fetch)


def _run_raw(case: Case) -> None:
    """The main block's runner alone: no verify, no feed checks."""
    import fluidps
    from fluidps.executor.block_runner import BlockRunner

    exe = fluidps.Executor(compile=False)
    exe.run(case.startup)
    runner = BlockRunner(case.main.global_block())
    for feed in case.feeds:
        env = {n: exe.scope[n] for n in exe.scope} | dict(case.scope) | dict(feed)
        columns = [op.output("Out")[0] for op in case.main.global_block().ops if op.type == "feed"]
        env["feed"] = [feed.get(name) for name in columns]  # (what Executor.run makes of a feed)
        runner.run(env)


def worker(seed: int, start: int, stop: int, cache_dir: str) -> None:
    """Run cases start..stop-1, one JSON line each, announced before they run."""
    import fluidps

    warnings.simplefilter("ignore")
    # An allocation past this fails with a MemoryError (an error fluidps must report), where
    # the machine's own memory would bring the OOM killer to the fuzzer and its neighbours.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    maker = Maker()
    fault = os.environ.get("FLUIDPS_FUZZ_FAULT", "")  # "abort:<i>" / "hang:<i>": the harness's own tests
    for index in range(start, stop):
        print(json.dumps({"begin": index}), flush=True)
        if fault == f"abort:{index}":
            os.abort()
        if fault == f"hang:{index}":
            time.sleep(3600)
        started = time.perf_counter()
        try:
            case = maker.case(seed, index)
        except fluidps.Error as e:  # bytes that do not parse, an edit the IR refuses
            outcome, detail = type(e).__name__, str(e)[:300]
        except Exception:
            outcome, detail = "other:making", traceback.format_exc()[-3000:]
        else:
            outcome, detail = run_case(case, cache_dir)
        seconds = round(time.perf_counter() - started, 3)
        print(
            json.dumps({"index": index, "outcome": outcome, "detail": detail, "seconds": seconds}), flush=True
        )


# -- the parent: workers, bounded waits -------------------------------------------------------


@dataclass
class Report:
    counts: Counter = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)  # not clean, not a fluidps.Error
    slowest: list[tuple[float, int]] = field(default_factory=list)  # (seconds, index) of the 5 slowest
    seconds: float = 0.0


def is_failure(outcome: str) -> bool:
    return outcome.startswith(("other:", "signal:", "timeout", "exit:", "out-of-bounds"))


def fuzz(
    programs: int, seed: int, jobs: int = 2, timeout: float = PROGRAM_TIMEOUT_S, cache_dir: str | None = None
) -> Report:
    """Run `programs` cases of `seed` in `jobs` worker processes at a time."""
    cache = cache_dir or str(Path(tempfile.gettempdir()) / "fluidps-fuzz-cache")
    report, lock, start = Report(), threading.Lock(), time.perf_counter()
    bounds = [programs * k // jobs for k in range(jobs + 1)]
    threads = [
        threading.Thread(target=_drive, args=(seed, lo, hi, cache, timeout, report, lock))
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report.seconds = round(time.perf_counter() - start, 1)
    return report


def _drive(
    seed: int, lo: int, hi: int, cache: str, timeout: float, report: Report, lock: threading.Lock
) -> None:
    next_index = lo
    while next_index < hi:
        _, culprit, how, stderr = _one_worker(seed, next_index, hi, cache, timeout, report, lock)
        if culprit is None:
            return
        failure = {"seed": seed, "index": culprit, "outcome": how, "detail": stderr[-2000:]}
        if how.startswith("signal:"):  # heap damage may kill a later program: find one that dies alone
            suspects = range(culprit, max(next_index, culprit - REPLAYED) - 1, -1)
            failure["dies_alone"] = next(
                (i for i in suspects if is_failure(_alone(seed, i, cache, timeout))), None
            )
        with lock:
            report.counts[how] += 1
            report.failures.append(failure)
        next_index = culprit + 1


def _alone(seed: int, index: int, cache: str, timeout: float) -> str:
    """The outcome of program `index` in a worker of its own."""
    scratch = Report()
    _, culprit, how, _ = _one_worker(seed, index, index + 1, cache, timeout, scratch, threading.Lock())
    return how if culprit is not None else next(iter(scratch.counts))


def describe(seed: int, index: int) -> str:
    """Program `index` of `seed` and how it runs, as text (made again, not run)."""
    try:
        return Maker().case(seed, index).describe()
    except Exception as e:
        return f"(cannot be made: {type(e).__name__}: {e})"


def _one_worker(seed, lo, hi, cache, timeout, report, lock):
    """Run a worker on lo..hi-1; (last index done, culprit index or None, outcome, stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env["NUMBA_BOUNDSCHECK"] = "1"  # a kernel past an array's end raises, named by run_case
    # ... compiled into a cache of their own: numba's cache index does not tell bounds-checked
    # code from plain, and the package's own cache would serve it to every later process.
    env["NUMBA_CACHE_DIR"] = str(Path(cache) / "numba-boundscheck")
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), "--worker", str(seed), str(lo), str(hi), cache],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, env=env, text=True,
        )  # fmt: skip
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        begun, last, how = None, lo - 1, None
        try:
            while True:
                if not selector.select(timeout):
                    how = "timeout"
                    break
                line = proc.stdout.readline()
                if not line:
                    break
                message = json.loads(line)
                if "begin" in message:
                    begun = message["begin"]
                    continue
                last, begun = message["index"], None
                with lock:
                    report.counts[message["outcome"]] += 1
                    report.slowest = sorted([*report.slowest, (message["seconds"], message["index"])])[-5:]
                    if is_failure(message["outcome"]):
                        report.failures.append({"seed": seed, **message})
        finally:
            if proc.poll() is None and how == "timeout":
                proc.kill()
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(timeout=30)
            proc.stdout.close()
            selector.close()
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    if begun is None and code == 0:
        return last, None, "", stderr
    if how is None:
        how = f"signal:{signal.Signals(-code).name}" if code < 0 else f"exit:{code}"
    if begun is None:  # between programs (at exit: freeing what an earlier one damaged)
        return last, last, f"{how} (after it ran)", stderr
    return last, begun, how, stderr


def main(argv: list[str]) -> None:
    if argv[:1] == ["--worker"]:
        seed, start, stop, cache = int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
        worker(seed, start, stop, cache)
        return
    raise SystemExit("usage: python -m bench.fuzz --programs N --seed S (this module's --worker is internal)")


if __name__ == "__main__":
    main(sys.argv[1:])

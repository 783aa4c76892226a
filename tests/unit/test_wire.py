"""The wire format: exact round trips, and strict decoding of anything malformed.

`decode` sees bytes from the network: whatever it is given, it returns a valid
Message or raises WireError, never another exception.
"""

from __future__ import annotations

import ast
from pathlib import Path

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fluidps.errors import WireError
from fluidps.executor.transport import wire_pb2 as pb
from fluidps.executor.transport.wire import (
    ALLOWED_DTYPES,
    MAX_BATCHES,
    MAX_DIM,
    MAX_DIMS,
    Kind,
    Message,
    decode,
    encode,
)
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops.selected_rows import SelectedRows

DTYPES = ["float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]
FP32 = int(VarType.FP32)
EXECUTOR = Path(__file__).resolve().parents[2] / "executor"


def roundtrip(msg: Message) -> Message:
    # bytes, as a copying recv_multipart would give them
    return decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(msg)])


def assert_same_tensor(got, want) -> None:
    if isinstance(want, SelectedRows):
        assert isinstance(got, SelectedRows)
        assert got.height == want.height
        assert_same_tensor(got.rows, want.rows)
        assert_same_tensor(got.value, want.value)
        return
    want = np.asarray(want)
    assert isinstance(got, np.ndarray)
    assert got.dtype == want.dtype.newbyteorder("=")
    assert got.shape == want.shape
    # bit for bit (NaN payloads and -0.0 included)
    assert got.tobytes() == np.ascontiguousarray(want, dtype=got.dtype).tobytes()


def assert_same(got: Message, want: Message) -> None:
    assert got.kind == want.kind
    assert (got.request_id, got.trainer_id, got.step, got.incarnation) == (
        want.request_id,
        want.trainer_id,
        want.step,
        want.incarnation,
    )
    assert (got.names, got.text, got.blobs, got.pending) == (want.names, want.text, want.blobs, want.pending)
    assert [list(b) for b in [got.tensors, *got.batches]] == [list(b) for b in [want.tensors, *want.batches]]
    for got_tensors, want_tensors in zip(
        [got.tensors, *got.batches], [want.tensors, *want.batches], strict=True
    ):
        for name, value in want_tensors.items():
            assert_same_tensor(got_tensors[name], value)


def header(*tensors: pb.TensorMeta, kind: int = Kind.SEND, **fields) -> bytes:
    h = pb.Header(kind=kind, **fields)
    h.tensors.extend(tensors)
    return h.SerializeToString()


def meta(name="w", dtype=FP32, dims=(2,), **fields) -> pb.TensorMeta:
    return pb.TensorMeta(name=name, dtype=dtype, dims=list(dims), **fields)


# -- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (2, 3, 4)])
def test_every_allowed_dtype_and_shape_round_trips(dtype, shape):
    rng = np.random.default_rng(0)
    array = (rng.normal(size=shape) * 50).astype(dtype)
    msg = Message(Kind.SEND, tensors={"x": array}, request_id=3, trainer_id=1, step=9, incarnation=77)
    got = roundtrip(msg)
    assert_same(got, msg)
    assert not got.tensors["x"].flags.writeable  # a view of the received frame


def test_allow_list_covers_the_tested_dtypes():
    assert {np.dtype(to_numpy_dtype(v)).name for v in ALLOWED_DTYPES} == set(DTYPES)


def test_large_tensor_and_non_contiguous_or_big_endian_inputs():
    big = np.random.default_rng(1).normal(size=(512, 1024)).astype("float32")  # 2 MiB
    strided = np.arange(60, dtype="float64").reshape(6, 10)[::2, 1::3]
    fortran = np.asfortranarray(np.arange(12, dtype="int32").reshape(3, 4))
    swapped = np.arange(5, dtype=">f8")
    msg = Message(Kind.VALUES, tensors={"big": big, "s": strided, "f": fortran, "be": swapped})
    got = roundtrip(msg)
    assert_same(got, msg)
    np.testing.assert_array_equal(got.tensors["be"], np.arange(5.0))


def test_encode_does_not_copy_contiguous_arrays():
    array = np.arange(1000, dtype="float32")
    frames = encode(Message(Kind.SEND, tensors={"a": array}))
    assert np.shares_memory(np.frombuffer(frames[1], dtype="float32"), array)


def test_selected_rows_names_text_blobs_pending_round_trip():
    sparse = SelectedRows(np.array([4, 0, 4]), np.arange(6, dtype="float32").reshape(3, 2), 5)
    empty = SelectedRows(np.zeros(0, dtype="int64"), np.zeros((0, 2), dtype="float64"), 5)
    msg = Message(
        Kind.SEND,
        tensors={"dense": np.ones((2, 2), "float32"), "emb@GRAD": sparse, "none": empty},
        names=["w", "b.block0", "ünïcode"],
        text="x" * 1000 + " ✓",
        blobs=[b"\x00program bytes\xff", b""],
        pending=[1, 2, 2**64 - 1],
        request_id=2**64 - 1,
        trainer_id=-1,
        step=-(2**63),
    )
    got = roundtrip(msg)
    assert_same(got, msg)
    assert len(encode(msg)) == 1 + 1 + 2 + 2 + 2


def test_a_run_of_several_batches_round_trips_each_batch_apart():
    """A name recurs across batches; a batch may be empty or hold rows."""
    sparse = SelectedRows(np.array([3, 1]), np.ones((2, 2), "float32"), 4)
    msg = Message(
        Kind.RUN,
        batches=[
            {"x": np.zeros((2, 3), "float32"), "ids": np.arange(2)},
            {},
            {"x": np.ones((1, 3)), "g": sparse},
        ],
        names=["loss"],
        text="trainer",
    )
    got = roundtrip(msg)
    assert_same(got, msg)
    assert got.tensors == {} and len(got.batches) == 3
    assert len(encode(msg)) == 1 + 2 + 1 + 2


def test_encode_refuses_tensors_beside_batches_and_batches_outside_run_and_values():
    with pytest.raises(WireError, match="carries its tensors in them"):
        encode(Message(Kind.RUN, tensors={"x": np.ones(2)}, batches=[{"x": np.ones(2)}]))
    with pytest.raises(WireError, match="a SEND message carries no batches"):
        encode(Message(Kind.SEND, batches=[{"x@GRAD": np.ones(2)}]))


def test_encode_refuses_dtypes_outside_the_allow_list():
    for value in (np.array(["a"]), np.array([1 + 2j]), np.array([object()])):
        with pytest.raises(WireError, match="cannot be sent"):
            encode(Message(Kind.SEND, tensors={"bad": value}))


# -- properties ----------------------------------------------------------------------------

names = st.text(min_size=1, max_size=12)
arrays = st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))
)


@st.composite
def selected_rows(draw):
    height = draw(st.integers(1, 50))
    n = draw(st.integers(0, 6))
    rows = draw(hnp.arrays("int64", n, elements=st.integers(0, height - 1)))
    value = draw(hnp.arrays(st.sampled_from(["float32", "float64"]), (n, draw(st.integers(0, 3)))))
    return SelectedRows(rows, value, height)


messages = st.builds(
    Message,
    kind=st.sampled_from([k for k in Kind.values() if k != Kind.UNKNOWN]),
    tensors=st.dictionaries(names, st.one_of(arrays, selected_rows()), max_size=4),
    names=st.lists(names, max_size=4),
    request_id=st.integers(0, 2**64 - 1),
    trainer_id=st.integers(-(2**31), 2**31 - 1),
    step=st.integers(-(2**63), 2**63 - 1),
    incarnation=st.integers(0, 2**64 - 1),
    text=st.text(max_size=40),
    blobs=st.lists(st.binary(max_size=16), max_size=3),
    pending=st.lists(st.integers(0, 2**64 - 1), max_size=4),
)
batched_messages = st.builds(
    Message,
    kind=st.sampled_from([Kind.RUN, Kind.VALUES]),
    batches=st.lists(
        st.dictionaries(names, st.one_of(arrays, selected_rows()), max_size=3), min_size=1, max_size=4
    ),
    names=st.lists(names, max_size=4),
    request_id=st.integers(0, 2**64 - 1),
)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.one_of(messages, batched_messages))
def test_valid_messages_round_trip_exactly(msg):
    assert_same(roundtrip(msg), msg)


def decode_or_wire_error(frames: list[bytes]) -> None:
    try:
        msg = decode(frames)
    except WireError as e:
        assert str(e)
        return
    assert isinstance(msg, Message) and msg.kind in Kind.values() and msg.kind != Kind.UNKNOWN
    assert not (msg.tensors and msg.batches)
    for value in [v for tensors in [msg.tensors, *msg.batches] for v in tensors.values()]:
        if isinstance(value, SelectedRows):
            assert value.rows.shape[0] == value.value.shape[0]
            assert value.rows.size == 0 or 0 <= value.rows.min() <= value.rows.max() < value.height
        else:
            assert isinstance(value, np.ndarray) and value.ndim <= MAX_DIMS


@FUZZ
@given(st.one_of(messages, batched_messages), st.data())
def test_mutated_messages_decode_or_raise_wire_error(msg, data):
    frames = [bytes(memoryview(f)) for f in encode(msg)]
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "add", "swap"]))
        i = data.draw(st.integers(0, len(frames) - 1)) if frames else 0
        if op == "add" or not frames:
            frames.insert(i, data.draw(st.binary(max_size=24)))
        elif op == "drop":
            del frames[i]
        elif op == "swap":
            j = data.draw(st.integers(0, len(frames) - 1))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == "truncate":
            frames[i] = frames[i][: data.draw(st.integers(0, max(len(frames[i]) - 1, 0)))]
        elif op == "extend":
            frames[i] = frames[i] + data.draw(st.binary(min_size=1, max_size=9))
        elif frames[i]:
            frame = bytearray(frames[i])
            pos = data.draw(st.integers(0, len(frame) - 1))
            frame[pos] = data.draw(st.integers(0, 255))
            frames[i] = bytes(frame)
    decode_or_wire_error(frames)


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_decode_or_raise_wire_error(frames):
    decode_or_wire_error(frames)


@FUZZ
@given(
    st.lists(
        st.builds(
            pb.TensorMeta,
            name=st.text(max_size=3),
            dtype=st.integers(-3, 30),
            dims=st.lists(st.sampled_from([-1, 0, 1, 2, 3, 2**40, 2**41, 2**62]), max_size=14),
            sparse=st.booleans(),
            height=st.sampled_from([-1, 0, 1, 3, 2**62]),
        ),
        max_size=3,
    ),
    st.integers(0, 3),
    st.lists(st.binary(max_size=48), max_size=7),
)
def test_random_headers_decode_or_raise_wire_error(metas, blobs, frames):
    decode_or_wire_error([header(*metas, blobs=blobs), *frames])


# -- specific malformed messages -----------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"\xff\xff\xff\xff"], "frame 0 is not a message header"),
        ([b"garbage that is no protobuf"], "not a message header|no known kind"),
        ([pb.Header().SerializeToString()], "no known kind"),
        ([pb.Header(kind=Kind.UNKNOWN).SerializeToString()], "no known kind"),
        ([b"\x08\x63"], "no known kind"),  # kind = 99, not in the enum
        ([header(meta(dtype=int(VarType.LOD_TENSOR))), b"\0" * 8], "dtype .* is not allowed"),
        ([header(meta(dtype=9999)), b"\0" * 8], "dtype 9999 is not allowed"),
        ([header(pb.TensorMeta(name="w", dims=[2])), b"\0" * 8], "is not allowed"),
        ([header(meta(dims=(2, -1))), b""], r"dims \[2, -1\] are not valid"),
        ([header(meta(dims=(1,) * (MAX_DIMS + 1))), b"\0" * 4], "are not valid"),
        ([header(meta(dims=(MAX_DIM + 1,))), b""], "are not valid"),
        ([header(meta(dims=(0, 2**40, 2**40, 2**40))), b""], "are not valid"),  # numpy would overflow
        ([header(meta(dims=(2**62, 2**62, 4))), b"\0" * 16], "are not valid"),
        ([header(meta(dims=(2, 3))), b"\0" * 23], r"need 24 bytes, the frame has 23"),
        ([header(meta(dims=(2, 3))), b"\0" * 25], r"need 24 bytes, the frame has 25"),
        ([header(meta(dims=(2,)))], "'w': its data frames are missing"),
        ([header(meta(), meta("v")), b"\0" * 8], "'v': its data frames are missing"),
        ([header(meta()), b"\0" * 8, b"extra"], "the header describes 2 frames, the message has 3"),
        ([header(meta(), blobs=2), b"\0" * 8, b"one blob"], "describes 4 frames, the message has 3"),
        ([header(meta(), meta()), b"\0" * 8, b"\0" * 8], "appears twice"),
        ([header(meta(name="")), b"\0" * 8], "a tensor name must have 1 to"),
        ([header(meta(name="n" * 2000)), b"\0" * 8], "a tensor name must have 1 to"),
        ([header(names=[""])], "a name must have 1 to"),
        ([header(meta(batch=0), kind=Kind.RUN), b"\0" * 8], "batch 0 in a message of 0 batches"),
        ([header(meta(), kind=Kind.RUN, batches=2), b"\0" * 8], "batch not given in a message of 2 batches"),
        ([header(meta(batch=2), kind=Kind.RUN, batches=2), b"\0" * 8], "batch 2 in a message of 2 batches"),
        (
            [header(meta(batch=1), meta(batch=1), kind=Kind.VALUES, batches=2), b"\0" * 8, b"\0" * 8],
            "appears twice in batch 1",
        ),
        ([header(kind=Kind.RUN, batches=MAX_BATCHES + 1)], f"{MAX_BATCHES + 1} batches in one message"),
        ([header(meta(batch=0), batches=1), b"\0" * 8], "a SEND message carries no batches"),
    ],
)
def test_malformed_messages_raise_wire_error(frames, match):
    with pytest.raises(WireError, match=match):
        decode(frames)


def sparse_meta(n=2, width=3, height=10) -> pb.TensorMeta:
    return meta("emb@GRAD", dims=(n, width), sparse=True, height=height)


def test_selected_rows_decodes_from_rows_and_values_frames():
    rows = np.array([1, 9], dtype="<i8").tobytes()
    got = decode([header(sparse_meta()), rows, np.ones((2, 3), "<f4").tobytes()])
    value = got.tensors["emb@GRAD"]
    assert isinstance(value, SelectedRows)
    assert value.rows.tolist() == [1, 9] and value.height == 10 and value.value.shape == (2, 3)


@pytest.mark.parametrize(
    ("rows", "sparse", "match"),
    [
        (np.array([1, 9], dtype="<i4").tobytes(), sparse_meta(), "2 rows need 16 bytes of row ids, got 8"),
        (np.array([1], dtype="<i8").tobytes(), sparse_meta(), "2 rows need 16 bytes of row ids, got 8"),
        (np.array([1, 2, 3], dtype="<i8").tobytes(), sparse_meta(), "need 16 bytes of row ids, got 24"),
        (np.array([1, 10], dtype="<i8").tobytes(), sparse_meta(), r"row ids must be in \[0, 10\)"),
        (np.array([-1, 0], dtype="<i8").tobytes(), sparse_meta(), r"row ids must be in \[0, 10\)"),
        (np.array([0, 0], dtype="<i8").tobytes(), sparse_meta(height=-5), r"row ids must be in"),
        (b"", sparse_meta(n=0, height=2**41), r"row ids must be in"),
    ],
)
def test_malformed_selected_rows_raise_wire_error(rows, sparse, match):
    n, width = sparse.dims
    with pytest.raises(WireError, match=match):
        decode([header(sparse), rows, b"\0" * (4 * n * width)])


def test_selected_rows_without_value_dims_or_frames():
    with pytest.raises(WireError, match="at least one dim"):
        decode([header(meta(dims=(), sparse=True, height=3)), b"", b"\0" * 4])
    with pytest.raises(WireError, match="data frames are missing"):
        decode([header(sparse_meta()), np.zeros(2, "<i8").tobytes()])


def test_wire_error_is_a_value_error():
    with pytest.raises(ValueError, match="empty message"):
        decode([])


# -- nothing that crossed a socket is unpickled or evaluated -------------------------------

FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_ATTRIBUTES = {"recv_pyobj", "send_pyobj", "recv_serialized", "loads_pickle"}


def test_executor_uses_no_pickle_recv_pyobj_or_eval():
    problems = []
    files = sorted(p for p in EXECUTOR.rglob("*.py") if p.name != "wire_pb2.py")
    assert any(p.name == "rpc.py" for p in files)
    for path in files:
        source = path.read_text()
        tree = ast.parse(source, str(path))
        # A parameter may bear a builtin's name (Executor(compile=True)): its uses are its own.
        # So may a field (JobDesc.compile): naming it (a store) runs nothing.
        parameters = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Import | ast.ImportFrom):
                modules = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                if any(m.split(".")[0] in FORBIDDEN_MODULES for m in modules):
                    problems.append(f"{where} imports {modules}")
            elif (
                isinstance(node, ast.Name)
                and isinstance(node.ctx, ast.Load)
                and node.id in (FORBIDDEN_CALLS - parameters) | FORBIDDEN_MODULES
            ):
                problems.append(f"{where} uses {node.id}")
            elif isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
                problems.append(f"{where} uses .{node.attr}")
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                problems.append(f"{where} passes allow_pickle")
    assert not problems, problems

"""Messages on the wire: encoding and strict decoding.

A message is a list of ZeroMQ frames: frame 0 is a `wire.Header` protobuf (with the
job's secret, preceded by the tag that proves it: fluidps.executor.transport.proof);
then one raw little-endian frame per dense tensor, two per SelectedRows (int64 rows,
then values), then `blobs` opaque frames (program bytes). A RUN of several batches,
and its reply, carries each batch's tensors in `batches` (on the wire: each tensor
tagged with its batch) instead of `tensors`. Arrays are sent without copying and
received as views of the frames (read-only when the frame is bytes; a zmq.Frame's
memory is the receiver's to keep, except over inproc://, where it may be the sender's
array itself). Decoding trusts nothing: every name, dtype, shape and byte count is
checked before an array is made, and anything off raises WireError.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from fluidps.errors import UnprovenMessageError, WireError
from fluidps.executor.transport import wire_pb2 as pb
from fluidps.executor.transport.proof import TAG_BYTES, JobSecret
from fluidps.ir.types import VarType, to_numpy_dtype, to_vartype
from fluidps.ops.selected_rows import HASHED_HEIGHT, SelectedRows

Kind = pb.Kind
ALLOWED_DTYPES = frozenset(
    {
        VarType.FP32,
        VarType.FP64,
        VarType.FP16,
        VarType.INT64,
        VarType.INT32,
        VarType.INT16,
        VarType.INT8,
        VarType.UINT8,
        VarType.BOOL,
    }
)
# Looked up once a tensor, so made once: each allowed dtype's wire number -> its
# little-endian numpy dtype, and each numpy dtype that may be sent -> its wire number.
_WIRE_DTYPES = {int(vt): to_numpy_dtype(vt).newbyteorder("<") for vt in ALLOWED_DTYPES}
_SENDABLE = {to_numpy_dtype(vt): vt for vt in ALLOWED_DTYPES}
MAX_DIMS = 12
MAX_DIM = 1 << 40
MAX_NAME = 1024
MAX_NAMES = 1 << 16
MAX_TEXT = 1 << 20
MAX_BATCHES = 1 << 12
_LITTLE = sys.byteorder == "little"


@dataclass
class Message:
    kind: int
    tensors: dict[str, Any] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    request_id: int = 0
    trainer_id: int = -1
    step: int = 0
    incarnation: int = 0
    text: str = ""
    blobs: list[bytes] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    sender: int = 0  # the sending process's incarnation (0: not said)
    barrier: bool = False  # SEND: also the trainer's send barrier of its step
    replaces: int = 0  # a trainer's messages: the incarnation of its id it replaces (0: none)
    # RUN and its VALUES reply: the feeds / fetches of each of several batches run in
    # order (empty: one batch, in `tensors`, which stays empty otherwise)
    batches: list[dict[str, Any]] = field(default_factory=list)
    micro_batch: int = 0  # STAGE_SEND: the micro-batch of `step` its values belong to

    @property
    def kind_name(self) -> str:
        return Kind.Name(self.kind) if self.kind in Kind.values() else str(self.kind)


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<")


def _frame(array: np.ndarray) -> memoryview:
    """A flat little-endian, C-contiguous view of `array` (copied only when needed)."""
    array = np.asarray(array, order="C")
    if not _LITTLE or array.dtype.byteorder == ">":
        array = array.astype(_wire_dtype(array.dtype))
    return memoryview(array.reshape(-1)).cast("B")


def _vartype(dtype: np.dtype, name: str) -> VarType:
    vt = _SENDABLE.get(dtype)  # (native byte order: the common case)
    if vt is not None:
        return vt
    try:
        vt = to_vartype(dtype.newbyteorder("="))
    except Exception as e:
        raise WireError(f"variable {name!r}: dtype {dtype} cannot be sent") from e
    if vt not in ALLOWED_DTYPES:
        raise WireError(f"variable {name!r}: dtype {dtype} cannot be sent")
    return vt


def encode(msg: Message, secret: JobSecret | None = None) -> list[Any]:
    """The frames of `msg`; tensors are referenced, not copied. With the job's `secret`,
    frame 0 starts with the tag that proves the header was made by a process of the job."""
    header = pb.Header(kind=msg.kind, request_id=msg.request_id, trainer_id=msg.trainer_id, step=msg.step)
    header.incarnation = msg.incarnation
    header.sender = msg.sender
    header.barrier = msg.barrier
    if msg.replaces:
        header.replaces = msg.replaces
    if msg.micro_batch:
        header.micro_batch = msg.micro_batch
    frames: list[Any] = []
    if msg.batches:
        if msg.kind not in (Kind.RUN, Kind.VALUES):
            raise WireError(f"a {msg.kind_name} message carries no batches: only RUN and VALUES do")
        if msg.tensors:
            raise WireError("a message of several batches carries its tensors in them, not in tensors")
        header.batches = len(msg.batches)
        for batch, tensors in enumerate(msg.batches):
            _encode_tensors(tensors, header, frames, batch)
    else:
        _encode_tensors(msg.tensors, header, frames, None)
    header.names.extend(msg.names)
    header.text = msg.text
    header.blobs = len(msg.blobs)
    header.pending.extend(msg.pending)
    head = header.SerializeToString()
    if secret is not None:
        head = secret.tag(head) + head
    return [head, *frames, *msg.blobs]


def _encode_tensors(tensors: dict[str, Any], header: pb.Header, frames: list[Any], batch: int | None) -> None:
    for name, value in tensors.items():
        meta = header.tensors.add(name=name)
        if batch is not None:
            meta.batch = batch
        if isinstance(value, SelectedRows):
            meta.sparse = True
            meta.height = value.height
            meta.dtype = _vartype(value.value.dtype, name)
            meta.dims.extend(value.value.shape)
            frames += [_frame(np.asarray(value.rows, dtype=np.int64)), _frame(value.value)]
        else:
            array = np.asarray(value)
            meta.dtype = _vartype(array.dtype, name)
            meta.dims.extend(array.shape)
            frames.append(_frame(array))


def _buffer(frame: Any) -> memoryview:
    buffer = getattr(frame, "buffer", frame)  # zmq.Frame (copy=False) or bytes
    return memoryview(buffer).cast("B")


def _text(value: Any, what: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise WireError(f"{what} is not valid UTF-8")
    if (not value and not allow_empty) or len(value) > MAX_NAME:
        raise WireError(f"{what} must have 1 to {MAX_NAME} characters")
    return value


def _long_text(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise WireError(f"the header text must be UTF-8 of at most {MAX_TEXT} characters")
    return value


def decode(frames: list[Any], secret: JobSecret | None = None) -> Message:
    """Parse and check a received message; WireError says what was wrong. With the job's
    `secret`, a message whose header does not carry its tag is refused before it is read
    (UnprovenMessageError)."""
    if not frames:
        raise WireError("empty message")
    head = bytes(_buffer(frames[0]))
    if secret is not None:
        if len(head) < TAG_BYTES or not secret.proves(head[:TAG_BYTES], head[TAG_BYTES:]):
            raise UnprovenMessageError("the message does not carry this job's proof")
        head = head[TAG_BYTES:]
    header = pb.Header()
    try:
        header.ParseFromString(head)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise WireError(f"frame 0 is not a message header: {e}") from None
    if not header.HasField("kind") or header.kind == Kind.UNKNOWN:
        raise WireError("the header has no known kind")
    if len(header.names) > MAX_NAMES or len(header.tensors) > MAX_NAMES:
        raise WireError("too many names or tensors in one message")
    if header.batches > MAX_BATCHES:
        raise WireError(f"{header.batches} batches in one message: at most {MAX_BATCHES}")
    if header.batches and header.kind not in (Kind.RUN, Kind.VALUES):
        raise WireError(f"a {Kind.Name(header.kind)} message carries no batches: only RUN and VALUES do")
    batches: list[dict[str, Any]] = [{} for _ in range(header.batches)]
    tensors: dict[str, Any] = {}
    index = 1
    for meta in header.tensors:
        name = _text(meta.name, "a tensor name")
        if meta.HasField("batch") != bool(batches) or meta.batch >= max(len(batches), 1):
            raise WireError(
                f"tensor {name!r}: batch {meta.batch if meta.HasField('batch') else 'not given'} "
                f"in a message of {len(batches)} batches"
            )
        into = batches[meta.batch] if batches else tensors
        if name in into:
            raise WireError(f"tensor {name!r} appears twice" + (f" in batch {meta.batch}" if batches else ""))
        needed = 2 if meta.sparse else 1
        if index + needed > len(frames):
            raise WireError(f"tensor {name!r}: its data frames are missing")
        into[name] = _tensor(meta, name, frames[index : index + needed])
        index += needed
    blobs = [bytes(_buffer(f)) for f in frames[index : index + header.blobs]]
    if index + header.blobs != len(frames):
        raise WireError(f"the header describes {index + header.blobs} frames, the message has {len(frames)}")
    return Message(
        kind=header.kind,
        tensors=tensors,
        names=[_text(n, "a name") for n in header.names],
        request_id=header.request_id,
        trainer_id=header.trainer_id,
        step=header.step,
        incarnation=header.incarnation,
        text=_long_text(header.text),
        blobs=blobs,
        pending=list(header.pending),
        sender=header.sender,
        barrier=header.barrier,
        replaces=header.replaces,
        batches=batches,
        micro_batch=header.micro_batch,
    )


def _tensor(meta: pb.TensorMeta, name: str, frames: list[Any]) -> Any:
    dtype = _WIRE_DTYPES.get(meta.dtype) if meta.HasField("dtype") else None
    if dtype is None:
        raise WireError(f"tensor {name!r}: dtype {meta.dtype} is not allowed")
    dims = list(meta.dims)
    # Zero-sized dims aside, the element count is bounded too: numpy refuses shapes
    # like [0, 2**40, 2**40] whose nonzero dims overflow its size arithmetic.
    if (
        len(dims) > MAX_DIMS
        or any(d < 0 or d > MAX_DIM for d in dims)
        or math.prod(max(d, 1) for d in dims) > MAX_DIM
    ):
        raise WireError(f"tensor {name!r}: dims {dims} are not valid")
    count = math.prod(dims)
    values = _buffer(frames[-1])
    if count * dtype.itemsize != values.nbytes:
        raise WireError(
            f"tensor {name!r}: dims {dims} of {dtype} need {count * dtype.itemsize} bytes, the frame has {values.nbytes}"
        )
    array = np.frombuffer(values, dtype=dtype).reshape(dims)
    if not meta.sparse:
        return array
    if not dims:
        raise WireError(f"sparse tensor {name!r}: its values need at least one dim (one per row)")
    rows_buffer = _buffer(frames[0])
    n_rows = dims[0]
    if rows_buffer.nbytes != n_rows * 8:
        raise WireError(
            f"sparse tensor {name!r}: {n_rows} rows need {n_rows * 8} bytes of row ids, got {rows_buffer.nbytes}"
        )
    rows = np.frombuffer(rows_buffer, dtype="<i8")
    height = meta.height
    # A hashed table's gradient spans every id (HASHED_HEIGHT); others are bounded tables.
    if (
        height < 0
        or (height > MAX_DIM and height != HASHED_HEIGHT)
        or (rows.size and (rows.min() < 0 or rows.max() >= height))
    ):
        raise WireError(f"sparse tensor {name!r}: row ids must be in [0, {height})")
    return SelectedRows(rows, array, height)


# -- JSON in a message's text (coordinator requests, settings) ----------------------------

OPTIONAL_FLOAT = "a number or null"


def json_fields(text: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The JSON object in a message's text, with exactly the keys of `schema` and values
    of their types (int, float, str, bool, or OPTIONAL_FLOAT); WireError otherwise."""
    try:
        body = json.loads(text)
    except ValueError:
        raise WireError(f"expected a JSON object, got {text[:80]!r}") from None
    if not isinstance(body, dict) or set(body) != set(schema):
        raise WireError(f"expected the fields {sorted(schema)}, got {text[:200]!r}")
    for key, kind in schema.items():
        value = body[key]
        if kind in (float, OPTIONAL_FLOAT):
            if value is None and kind == OPTIONAL_FLOAT:
                continue
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok:
                body[key] = float(value)
        else:
            ok = isinstance(value, kind) and isinstance(value, bool) == (kind is bool)
        if not ok:
            raise WireError(f"field {key!r} has a bad value {value!r}")
    return body

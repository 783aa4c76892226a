"""Saving and loading variables, persistables and inference models in
PaddlePaddle's own file formats (no pickle anywhere); datasets and streams of records.

    fluidps.io.save_persistables(exe, "ckpt", main)           # one file per variable
    fluidps.io.load_persistables(exe, "ckpt", main)
    fluidps.io.save_inference_model("model", ["x"], [pred], exe, main)
    program, feed_names, fetch_targets = fluidps.io.load_inference_model("model", exe)
    log = fluidps.io.StreamLog("clicks"); log.append({"ids": ids, "label": labels})
    fluidps.io.Exporter("exports", ["x"], [pred], main).export(scope)   # a version for serving

May import: fluidps.errors, fluidps.ir, fluidps.ops
"""

from fluidps.io.checkpoints import merge_checkpoints
from fluidps.io.dataset import Dataset, Field, Shard, Task
from fluidps.io.exports import Exporter, load_export
from fluidps.io.inference import load_inference_model, prune_for_inference, save_inference_model
from fluidps.io.persistables import (
    is_parameter,
    is_persistable,
    load_params,
    load_persistables,
    load_vars,
    save_params,
    save_persistables,
    save_vars,
)
from fluidps.io.stream import BadRecord, Records, StreamSource, open_stream
from fluidps.io.stream_log import StreamLog
from fluidps.io.tensor_file import (
    TensorReader,
    lod_tensor_from_bytes,
    lod_tensor_to_bytes,
    selected_rows_from_bytes,
    selected_rows_to_bytes,
)

__all__ = [
    "BadRecord",
    "Dataset",
    "Exporter",
    "Field",
    "Records",
    "Shard",
    "StreamLog",
    "StreamSource",
    "Task",
    "TensorReader",
    "is_parameter",
    "is_persistable",
    "load_export",
    "load_inference_model",
    "load_params",
    "load_persistables",
    "load_vars",
    "lod_tensor_from_bytes",
    "lod_tensor_to_bytes",
    "merge_checkpoints",
    "open_stream",
    "prune_for_inference",
    "save_inference_model",
    "save_params",
    "save_persistables",
    "save_vars",
    "selected_rows_from_bytes",
    "selected_rows_to_bytes",
]

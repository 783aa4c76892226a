"""The executor compiler: a block's ops as numba-compiled segments.

`compile_block` cuts a block into maximal runs of ops that have a lowering
(fluidps.ops.lowering) and turns each run into one numba function, generated as
Python source: the ops' statements in order on local variables, calling the same
numba helpers their kernels call. A step then costs one compiled call per
segment instead of one Python call (and its dictionary traffic) per op. Ops with
no compiled form (communication, readers, control flow, SelectedRows operands)
stay with the interpreter, between segments (fluidps.executor.block_runner).

- codegen.py:  one segment's source: its inputs, its statements, what it returns
- fusion.py:   runs of elementwise ops as one loop each (bias + activation, their grads)
- batching.py: updates of many parameters (sgd, adam) as one loop over them
- buffers.py:  liveness over a segment: a run stores its outputs in arrays dead by then
- cache.py:    the generated modules on disk, so that numba's cache serves a new process
- segments.py: which ops form segments, and the compiled callables
- ahead.py:    a block compiled on a thread of its own while it runs interpreted

May import: fluidps.errors, fluidps.ir, fluidps.ops
"""

from fluidps.executor.compiler.cache import ModuleCache, default_cache_dir
from fluidps.executor.compiler.segments import MIN_OPS, Compiler, Segment, compile_block, explain

__all__ = ["MIN_OPS", "Compiler", "ModuleCache", "Segment", "compile_block", "default_cache_dir", "explain"]

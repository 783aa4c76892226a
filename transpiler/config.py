"""DistributeTranspilerConfig: how a program is split over parameter servers."""

from __future__ import annotations

from dataclasses import dataclass

from fluidps.errors import BuilderError, UnsupportedError

MODES = ("sync", "async", "ssp")
SPLIT_METHODS = ("RoundRobin", "HashName", "Cost")
MERGES = ("auto", "sum", "mean")


@dataclass(frozen=True)
class DistributeTranspilerConfig:
    """
    slice_var_up: cut parameters into row blocks so one large table spreads over pservers.
    split_method: "RoundRobin" (blocks to pservers in turn) or "HashName" (crc32 of the
      block's name, stable across runs and machines). HashName placement does not
      balance bytes (a pserver may get most of a model, or nothing); RoundRobin deals
      each parameter's row blocks out in turn, so the large parameters, cut into one
      block per pserver, spread evenly. "Cost" (or "cost") balances the pservers'
      predicted work a step (fluidps.transpiler.pserver_cost): the largest block first,
      each to the pserver with the least so far; DistributedPlan.loads() reports it.
    min_block_size: the fewest elements a block may have (blocks are whole rows).
    mode: "sync" (barriers; gradients averaged over trainers), "async" (each gradient
      applied as it arrives) or "ssp" (async, but no trainer more than `staleness`
      steps ahead of the slowest).
    send_interval / recv_interval: async only: upload gradients every n mini-batches,
      download parameters every m.
    optimizer_state_with_slice: accumulators (moments, velocities) are cut like their
      parameter and live with each slice; Adam's beta powers, one-element scalars, are
      copied whole to each slice. This is the layout fluidps implements.
    checkpoint_dir: where the pservers save checkpoints and restore them from when they
      start ("" none; FLUIDPS_CHECKPOINT_DIR overrides it, as `fluidps launch --dataset`
      sets); checkpoint_every_steps / checkpoint_every_seconds: how often (0: never by
      that measure; they also save at the end, on SIGTERM and when asked);
      checkpoint_keep: how many each pserver keeps; checkpoint_base_every: of every n
      checkpoints, the first is a base and the others are deltas of it, in which hashed
      tables hold only the rows updated since the base (1: every one is a base).
    distributed_table_min_rows: sparse embedding tables (is_sparse lookups) of at least
      this many rows become distributed tables, as if marked is_distributed: they stay
      on the pservers and trainers prefetch only the rows of their batch (0: only tables
      marked is_distributed).
    send_bucket_bytes: each gradient's send comes right after the op that computes it (in
      backward order), so pservers optimize a parameter while the trainer computes the
      gradients of the layers below. A trainer holds gradients for a pserver until this
      many bytes are held (a bigger message costs less than several small ones), then
      sends them without waiting; the rest ride on the step's last message (0: every
      send goes at once). The default, 1 MiB, is about what a message's fixed cost (the
      hops and the handling at both ends, 0.3 ms here) would move over a loopback: a
      smaller model's gradients all ride on the last message (the digits MLP ran 7-10%
      faster in a 1x1 sync job than with 256 KiB, now that its updates are fast).
    communicator: async only (off by default, as Fluid's transpiler). Each trainer's
      gradients are queued per variable and sent by a thread of its own (Fluid's
      Communicator), so a step does not wait for the network: the thread merges what
      queued up while the last message was in flight, at most
      communicator_max_merge_var_num gradients of a variable into one, by
      communicator_merge: "sum", "mean" or "auto" (sum for parameters updated by
      sgd, where a sum moves the parameter as far as the gradients applied one by one;
      mean for the others, whose updates assume one gradient's scale). Each variable's
      queue holds at most communicator_send_queue_size gradients: a trainer that
      outruns its pservers waits in its send op (and says so in the log) rather than
      growing without bound. Parameters are pulled by that thread too, every
      recv_interval steps; a step uses the last values pulled (only the first pull is
      waited for). The price is staleness: steps compute on older parameters and
      merged gradients make fewer updates, so a model may need more steps to reach the
      same loss (docs/performance/0007-launch-and-communicator.md has a measured case).
    """

    slice_var_up: bool = True
    split_method: str = "RoundRobin"
    min_block_size: int = 8192
    mode: str = "sync"
    staleness: int = 0
    send_interval: int = 1
    recv_interval: int = 1
    optimizer_state_with_slice: bool = True
    checkpoint_dir: str = ""
    checkpoint_every_steps: int = 0
    checkpoint_every_seconds: float = 0.0
    checkpoint_keep: int = 3
    checkpoint_base_every: int = 1
    distributed_table_min_rows: int = 0
    send_bucket_bytes: int = 1024 * 1024
    communicator: bool = False
    communicator_merge: str = "auto"
    communicator_max_merge_var_num: int = 20
    communicator_send_queue_size: int = 20

    def __post_init__(self) -> None:
        if self.split_method == "cost":  # (accepted as written in lower case too)
            object.__setattr__(self, "split_method", "Cost")
        if self.split_method not in SPLIT_METHODS:
            raise BuilderError(f"split_method must be one of {SPLIT_METHODS}, got {self.split_method!r}")
        if self.mode not in MODES:
            raise BuilderError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.min_block_size < 1:
            raise BuilderError(f"min_block_size must be >= 1, got {self.min_block_size}")
        if self.staleness < 0:
            raise BuilderError(f"staleness must be >= 0, got {self.staleness}")
        if self.staleness and self.mode != "ssp":
            raise BuilderError(f"staleness applies to mode 'ssp' only (mode is {self.mode!r})")
        for name in ("send_interval", "recv_interval"):
            value = getattr(self, name)
            if value < 1:
                raise BuilderError(f"{name} must be >= 1, got {value}")
            if value != 1 and self.mode != "async":
                raise BuilderError(f"{name} applies to mode 'async' only (mode is {self.mode!r})")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_seconds < 0 or self.checkpoint_keep < 1:
            raise BuilderError(
                "checkpoint_every_steps and checkpoint_every_seconds must be >= 0 and checkpoint_keep >= 1, got "
                f"{self.checkpoint_every_steps}, {self.checkpoint_every_seconds}, {self.checkpoint_keep}"
            )
        if self.checkpoint_base_every < 1:
            raise BuilderError(
                f"checkpoint_base_every must be >= 1 (1: every checkpoint is a base), got {self.checkpoint_base_every}"
            )
        if self.distributed_table_min_rows < 0:
            raise BuilderError(
                f"distributed_table_min_rows must be >= 0 (0: only is_distributed tables), "
                f"got {self.distributed_table_min_rows}"
            )
        if self.send_bucket_bytes < 0:
            raise BuilderError(f"send_bucket_bytes must be >= 0, got {self.send_bucket_bytes}")
        if self.communicator and self.mode != "async":
            raise BuilderError(
                f"communicator applies to mode 'async' only (mode is {self.mode!r}): sync and ssp "
                "steps wait for the pservers by design"
            )
        if self.communicator_merge not in MERGES:
            raise BuilderError(f"communicator_merge must be one of {MERGES}, got {self.communicator_merge!r}")
        for name in ("communicator_max_merge_var_num", "communicator_send_queue_size"):
            if getattr(self, name) < 1:
                raise BuilderError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.optimizer_state_with_slice:
            raise UnsupportedError(
                "optimizer_state_with_slice=False: each slice's optimizer op updates that slice's "
                "accumulators, so they must live on the same pserver; fluidps keeps them together"
            )

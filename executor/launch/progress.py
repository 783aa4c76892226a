"""The launcher's view of a dataset job: the coordinator's status, polled, and a progress bar.

pass 2/5: 37/57 tasks [00:04, 9.1 tasks/s, samples/s=9.4e+03, loss=0.182]
"""

from __future__ import annotations

import json
import time
from typing import IO, Any

import zmq
from tqdm import tqdm

from fluidps.errors import TransportError
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message


class CoordinatorWatch:
    """Asks the coordinator for its status; a coordinator down or restarting just gives None."""

    def __init__(self, endpoint: str, settings: RpcSettings):
        self.endpoint, self.settings = endpoint, settings
        self._context = zmq.Context()
        self._client: RpcClient | None = None
        self.last: dict[str, Any] | None = None

    def poll(self) -> dict[str, Any] | None:
        if self._client is None:
            self._client = RpcClient(self._context, self.endpoint, "the coordinator", self.settings)
        try:
            reply = self._client.call(Message(Kind.STATUS), timeout=2.0)
            status = json.loads(reply.text)
        except (TransportError, ValueError):
            self._client.close()
            self._client = None
            return None
        self.last = status if isinstance(status, dict) else None
        return self.last

    @property
    def finished(self) -> bool:
        return bool(self.last and self.last.get("finished"))

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._context.term()


class ProgressBar:
    """A tqdm bar per pass: tasks done of the pass's tasks, samples/s and the mean loss."""

    def __init__(self, file: IO[str], enabled: bool | None):
        self.file, self.enabled = file, enabled
        self._bar: tqdm | None = None
        self._pass = -1
        self._samples = (0, time.monotonic())

    def update(self, status: dict[str, Any] | None) -> None:
        if not status or not status.get("configured"):
            return
        if "stream" in status:
            self._update_stream(status["stream"])
            return
        current = int(status["pass"])
        if current != self._pass:
            if self._bar is not None:  # the pass it showed is over
                self._bar.update(self._bar.total - self._bar.n)
            self.close()
            self._pass = current
            self._bar = tqdm(
                total=int(status["tasks_this_pass"]),
                desc=f"pass {current + 1}/{status['passes']}",
                unit="task",
                file=self.file,
                disable=False if self.enabled else None,  # None: only on a terminal
                leave=True,
                dynamic_ncols=True,
            )
        bar = self._bar
        assert bar is not None
        done = int(status["tasks_this_pass"]) if status["finished"] else int(status["done"])
        bar.total = int(status["tasks_this_pass"])
        bar.update(max(done - bar.n, 0))
        total, now = int(status["total_samples"]), time.monotonic()
        seen, then = self._samples
        rate = (total - seen) / (now - then) if now > then and total >= seen else 0.0
        self._samples = (total, now)
        postfix = {"samples/s": f"{rate:,.0f}"}
        if status.get("loss") is not None:
            postfix["loss"] = f"{status['loss']:.4f}"
        if status.get("discarded"):
            postfix["discarded"] = str(len(status["discarded"]))
        bar.set_postfix(postfix, refresh=False)
        bar.refresh()

    def _update_stream(self, stream: dict[str, Any]) -> None:
        """A stream has no passes: records applied, their rate, the committed offset and
        the windows in hand (offsets are not counts where they are sparse: no "behind")."""
        if self._bar is None:
            self._bar = tqdm(
                desc=f"stream {stream['source']}",
                unit="record",
                file=self.file,
                disable=False if self.enabled else None,
                leave=True,
                dynamic_ncols=True,
            )
        records = int(stream["records"])
        self._bar.update(max(records - self._bar.n, 0))
        self._bar.set_postfix({"committed": stream["committed"], "in hand": stream["pending"]}, refresh=False)
        self._bar.refresh()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

"""`fluidps launch --dataset`'s restart budget (a sliding window, a backoff, a peer's
failure counted apart) and how a launched process tells it a peer failed it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fluidps.errors import ExecutionError, PeerLostError, PeerRestartedError, RemoteError
from fluidps.executor.launch.restarts import BACKOFF, BACKOFF_MAX, PEER_FACTOR, RestartBudget
from fluidps.executor.peer_exit import ENV, PEER_FAILURE_STATUS, caused_by_peer


def test_the_budget_counts_restarts_within_a_sliding_window():
    budget = RestartBudget(limit=3, window=300.0)
    for t in (0.0, 10.0, 20.0):
        assert budget.allows("trainer.0", 1, t)
        budget.record("trainer.0", 1, t)
    assert not budget.allows("trainer.0", 1, 30.0)  # a crash loop ends the job
    assert budget.allows("trainer.1", 1, 30.0)  # each process has its own
    assert budget.allows("trainer.0", 1, 301.0)  # the first restart left the window
    assert budget.used("trainer.0", 301.0) == 2


def test_the_backoff_doubles_with_recent_restarts_up_to_its_cap():
    budget = RestartBudget(limit=100, window=300.0)
    delays = [budget.record("pserver.0", -9, float(t)) for t in range(8)]
    assert delays[:3] == [BACKOFF, 2 * BACKOFF, 4 * BACKOFF]
    assert delays[-1] == BACKOFF_MAX
    assert budget.record("pserver.0", -9, 1000.0) == BACKOFF  # the window forgot them


def test_a_peer_s_failure_does_not_spend_the_process_s_own_budget():
    budget = RestartBudget(limit=3, window=300.0)
    for t in range(3 * PEER_FACTOR):
        assert budget.allows("trainer.0", PEER_FAILURE_STATUS, float(t))
        budget.record("trainer.0", PEER_FAILURE_STATUS, float(t))
    assert budget.used("trainer.0", 20.0) == 0 and budget.allows("trainer.0", 1, 20.0)
    assert not budget.allows("trainer.0", PEER_FAILURE_STATUS, 20.0)  # but nothing restarts forever


def test_what_counts_as_a_peer_s_failure():
    try:
        try:
            raise PeerRestartedError("pserver 1 restarted")
        except PeerRestartedError as e:
            raise ExecutionError("block 0, op #27 (send) failed") from e
    except ExecutionError as e:
        assert caused_by_peer(e)
    assert caused_by_peer(PeerLostError("silent"))
    assert not caused_by_peer(RemoteError("pserver 0: holds no gradient 'x'"))
    assert not caused_by_peer(ValueError("a bug"))


SCRIPT = """
import sys
import fluidps
from fluidps.errors import ExecutionError, PeerRestartedError
fluidps.role_from_env()
try:
    raise PeerRestartedError("pserver 0 restarted")
except PeerRestartedError as e:
    if sys.argv[1] == "peer":
        raise ExecutionError("the step failed") from e
raise ValueError("the program's own bug")
"""


@pytest.mark.parametrize("cause, status", [("peer", PEER_FAILURE_STATUS), ("own", 1)])
def test_a_launched_process_exits_with_the_peer_status_only_for_a_peer_s_failure(tmp_path, cause, status):
    env = os.environ | {
        "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1",
        "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:6000", ENV: str(PEER_FAILURE_STATUS),
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, cause], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == status, done.stderr
    assert "Traceback" in done.stderr  # the traceback is printed as usual

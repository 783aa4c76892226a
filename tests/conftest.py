"""pytest configuration shared by every tier."""

from __future__ import annotations

import os

# Small matrices on a loaded 2-core CI machine: a multi-threaded BLAS only
# adds contention. Set before numpy / SciPy load their BLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
from rpc_harness import TRANSPORTS, Net, endpoint_for  # noqa: E402

from helpers import build_mlp  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--under-load",
        action="store_true",
        help="run every test in tests/distributed while two CPU-bound processes compete "
        "(tests marked under_load always do)",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "under_load: run while two CPU-bound processes compete (tests/distributed/conftest.py)"
    )


@pytest.fixture
def mlp():
    """(main, startup, loss) of the quick start's MLP."""
    return build_mlp()


@pytest.fixture
def net():
    """A transport test's servers, harnesses and clients (rpc_harness.Net), closed after it."""
    net = Net()
    yield net
    net.close()


@pytest.fixture(params=TRANSPORTS)
def endpoint(request, tmp_path):
    """An endpoint on each transport in turn: tcp 127.0.0.1, ipc:// and inproc://."""
    return endpoint_for(request.param, tmp_path)

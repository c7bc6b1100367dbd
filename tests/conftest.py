"""Eight fake CPU devices for every test, set before JAX starts its backend; XLA's CPU backend
without LLVM's optimizations (set before any backend starts, and inherited by every process a test
starts); and the ``stores`` fixture of the tensor store tests.

The tests check what the library does with the programs (layouts, bytes, equality between runs
under the same flags), not how fast the compiled code runs: unoptimized code compiles in about
half the time (a resize test: 27 s of CPU against 15 s), and the suite is mostly compiles."""

import os

import jax
import pytest

os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"])
)

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def stores(tmp_path):
    """Store servers started in the test's directory, ``stores.start(name, **kwargs)``; each one
    is killed and reaped by PID at the end."""
    from tests.helpers import Stores

    started = Stores(tmp_path)
    try:
        yield started
    finally:
        started.reap()


# The files that take longest on 2 cores, longest first (a full run's durations, 2026-11-27:
# 77, 72, 66, 52, 51, 47, 42, 36, 34 and 32 s of the suite's 792). xdist hands each file to one
# worker in collection order (``--no-loadscope-reorder``), so these start first and the short files
# fill in beside them. xdist's own order, most tests first, left a one-test file of 20 s and the Ray
# cluster's fixture for last (the whole suite: 453 s in that order, 412 s in this one, under loads
# of 2-5 and 1-3).
SLOWEST_FILES = (
    "test_launch.py",
    "test_ray.py",
    "test_wsp.py",
    "test_wsp_worker.py",
    "test_elastic.py",
    "test_pipeline.py",
    "test_ps_faults.py",
    "test_wsp_group.py",
    "test_device_independence.py",
    "test_store_hostile.py",
    "test_cli.py",
    "test_growth.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FILES)))

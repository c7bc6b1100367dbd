"""Eight fake CPU devices for every test, set before JAX starts its backend; XLA's CPU backend
without LLVM's optimizations and with the flags bitwise training needs (set before any backend
starts, and inherited by every process a test starts); and the ``stores`` fixture of the tensor
store tests.

The tests check what the library does with the programs (layouts, bytes, equality between runs
under the same flags), not how fast the compiled code runs: unoptimized code compiles in about
half the time (a resize test: 27 s of CPU against 15 s), and the suite is mostly compiles."""

import gc
import os

import jax
import pytest

import tenplex_jax as tj

if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):  # not inherited
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0"])
    )
tj.elastic.use_bitwise_flags()

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

# The imported modules are never garbage, and a test's tracing allocates objects by the million:
# the collector skips the first and runs a tenth as often (about 3 % of a core file's time).
gc.collect()
gc.freeze()
gc.set_threshold(10_000, 10, 10)


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


# The folders are the seams, each a marker (``pytest -m core``): the one-process library, and the
# wings that stand on it. xdist hands each file to one worker in collection order
# (``--no-loadscope-reorder``): the wings' files, which start processes and servers and take
# longest, go first, and the core's many short files fill in beside them.
FOLDERS = ("multihost", "wsp", "tools", "simulator", "core")


def pytest_collection_modifyitems(items):
    for item in items:
        folder = item.path.parent.name
        if folder not in FOLDERS:
            raise pytest.UsageError(f"{item.nodeid}: a test lives in one of tests/{FOLDERS}")
        item.add_marker(folder)
    items.sort(key=lambda item: FOLDERS.index(item.path.parent.name))

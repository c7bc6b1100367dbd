"""Eight fake CPU devices for every test, set before JAX starts its backend; the order the
test files run in; and the ``stores`` fixture of the tensor store tests."""

import jax
import pytest

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


# The files that take longest on 2 cores, longest first (seconds, summed test durations under
# ``-n 2``: the Ray job 100, the launched job 90, ...). With ``--dist loadfile`` a worker takes the
# next file when it is done with one; in this order the long ones start at once and the short ones
# fill in at the end. xdist's own order (``--loadscope-reorder``, most tests first) left the Ray
# job and the expert runs for the last two minutes, one worker idle beside them. The two
# multi-process jobs (Ray's and the launcher's) are not started together: each runs beside
# single-process files (side by side on 2 cores, a store write of the Ray job timed out once).
LONGEST_FIRST = (
    "test_ray.py",
    "test_elastic.py",
    "test_cli.py",
    "test_launch.py",
    "test_pipeline.py",
    "test_device_independence.py",
    "test_wsp.py",
    "test_ps_faults.py",
    "test_wsp_policy.py",
    "test_experts.py",
    "test_compile_ahead.py",
    "test_executor.py",
    "test_store_hostile.py",
    "test_bench.py",
    "test_docs.py",
    "test_simulator.py",
    "test_wsp_worker.py",
    "test_store.py",
    "test_checkpoint.py",
    "test_models.py",
    "test_training.py",
)


def pytest_collection_modifyitems(items):
    """The files of ``LONGEST_FIRST`` in its order, then the others as collected; the tests of a
    file keep their order (the sort is stable)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))

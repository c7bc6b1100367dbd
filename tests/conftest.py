"""Eight fake CPU devices for every test, set before JAX starts its backend; and the ``stores``
fixture of the tensor store tests."""

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

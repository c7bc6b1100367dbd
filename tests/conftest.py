"""Eight fake CPU devices for every test, set before JAX starts its backend."""

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

"""Data: the dataset PTC's batch layout and cursor, a global batch on the devices, its gradient.

:class:`tenplex_jax.DatasetPTC` (top level) is the dataset as a seeded order of sample indices;
what lays its batches out over a mesh and its ``Remainder`` kinds live here. In a train step, the
gradient over a batch is ``batch.value_and_grad(per_example_loss)(model)`` on the
:class:`tenplex_jax.Batch` that ``ElasticJob.next`` hands out; :func:`batch_value_and_grad` is the
same for a loop that lays its own batches out with :func:`device_batch`.
"""

from tenplex_jax._src.batch import BATCH_AXES, batch_value_and_grad, device_batch
from tenplex_jax._src.data import BatchLayout, DataState, Remainder

__all__ = [
    "BATCH_AXES",
    "BatchLayout",
    "DataState",
    "Remainder",
    "batch_value_and_grad",
    "device_batch",
]

"""Every error tenplex_jax raises: :class:`TenplexError` and its kinds.

Each message states the rule first, then the values that broke it: the tree path, the shape, the
PartitionSpec and the mesh (with its axis types). The layout, data, checkpoint and plan errors are
also ``ValueError``; the store, virtual-worker and launcher errors also ``RuntimeError``.
"""

from tenplex_jax._src.errors import (
    CheckpointError,
    DataError,
    LaunchError,
    LayoutError,
    LeafNotFoundError,
    LostShardsError,
    PlanError,
    StoreError,
    TenplexError,
    WSPError,
)

__all__ = [
    "CheckpointError",
    "DataError",
    "LaunchError",
    "LayoutError",
    "LeafNotFoundError",
    "LostShardsError",
    "PlanError",
    "StoreError",
    "TenplexError",
    "WSPError",
]

"""The types tenplex_jax's functions take and return, for annotations (as ``flax.typing``).

``Box``/``Shape``: an index box ``((start, stop), ...)`` and a shape; ``Rules``: flax's
logical-axis rules; ``LeafLayout``: one leaf of a PTC; ``Plan`` (with ``LeafPlan``, ``ShardPlan``,
``Piece``, ``ShardKind``): what ``make_plan`` returns; ``ReshardMethod``/``Executor``: how
``reshard`` copies; ``ReshardReport``: what ``reshard`` returns with the state;
``Restored``/``Saved``: what ``restore_checkpoint``/``save_checkpoint`` return.
"""

from tenplex_jax._src.box import Box, Shape
from tenplex_jax._src.checkpoint import Restored, Saved
from tenplex_jax._src.executor import Executor, ReshardMethod, ReshardReport
from tenplex_jax._src.plan import LeafPlan, Piece, Plan, ShardKind, ShardPlan
from tenplex_jax._src.ptc import LeafLayout
from tenplex_jax._src.rules import Rules

__all__ = [
    "Box",
    "Executor",
    "LeafLayout",
    "LeafPlan",
    "Piece",
    "Plan",
    "ReshardMethod",
    "ReshardReport",
    "Restored",
    "Rules",
    "Saved",
    "Shape",
    "ShardKind",
    "ShardPlan",
]

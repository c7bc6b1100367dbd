"""The policies the simulator compares, and the costs its network model does not derive.

Imports nothing heavy, so the command line can show the defaults without starting JAX.
"""

from __future__ import annotations

import dataclasses

POLICIES = ("tenplex", "central", "checkpoint-restart")
"""The policies ``simulate`` compares: tenplex's transformation from the tensor stores, the same
with every byte through one node (Tenplex-Central), and checkpoint-restart through storage."""


@dataclasses.dataclass(frozen=True)
class Costs:
    """What the network model does not derive, for a job at the cluster's scale.

    Attributes:
      restart_seconds: new processes up to their first collective (start-up,
        ``jax.distributed`` initialize, the runtime's communicators).
      compile_seconds: the new layout's train step, compiled cold.
      commit_every: steps between commits to the stores.
      checkpoint_minutes: minutes between orbax checkpoints (None: the trace's
        ``checkpoint_every``, else 30).
      replicas: store copies beyond the writer's.
      piece_seconds: a fixed cost per piece a device receives (a message or kernel launch).
    """

    restart_seconds: float = 60.0
    compile_seconds: float = 120.0
    commit_every: int = 10
    checkpoint_minutes: float | None = None
    replicas: int = 1
    piece_seconds: float = 0.0

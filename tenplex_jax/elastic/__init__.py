"""The elastic loop: a training job whose devices change under it, in one process or launched.

``job.py`` is :class:`ElasticJob` (events, reconfigurations, checkpoints, commits when launched),
``steps.py`` the user's step compiled per layout (and ahead), ``trace.py`` resource traces and
their replay against checkpoint-restart.
"""

from tenplex_jax.elastic.job import KINDS, ElasticJob, EventRecord
from tenplex_jax.elastic.steps import StepCache, enable_compilation_cache
from tenplex_jax.elastic.trace import ResourceTrace, TraceEvent, replay

__all__ = [
    "KINDS",
    "ElasticJob",
    "EventRecord",
    "ResourceTrace",
    "StepCache",
    "TraceEvent",
    "enable_compilation_cache",
    "replay",
]

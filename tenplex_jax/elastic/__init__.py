"""The elastic loop's parts beside :class:`tenplex_jax.ElasticJob`: its options, the launched
job, event records, resource traces and their replay, and JAX's persistent compilation cache.

``JobOptions`` holds how a job runs (compile-ahead, reshard method, step timing, ...);
``LaunchedJob`` is what ``tj.ElasticJob(...)`` builds in a process of ``tenplex-jax launch``;
``ResourceTrace.load(path)`` reads a trace of device changes; ``replay(job, state, step, trace)``
drives a job through it; ``EventRecord`` is what ``job.records`` holds for every event.
"""

from tenplex_jax._src.elastic.core import JobOptions
from tenplex_jax._src.elastic.events import EventRecord
from tenplex_jax._src.elastic.launched import LaunchedJob
from tenplex_jax._src.elastic.steps import enable_compilation_cache
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent, replay

__all__ = [
    "EventRecord",
    "JobOptions",
    "LaunchedJob",
    "ResourceTrace",
    "TraceEvent",
    "enable_compilation_cache",
    "replay",
]

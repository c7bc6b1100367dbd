"""The elastic loop's parts beside :class:`tenplex_jax.ElasticJob`: its options, event records,
resource traces and their replay, JAX's persistent compilation cache, and what a runtime uses.

``JobOptions`` holds how a job runs (compile-ahead, reshard method, step timing, bitwise
changes, ...); ``use_bitwise_flags()`` sets the XLA flags a bitwise job needs, before JAX starts;
``use_job_class(cls)`` is how a runtime (``tenplex-jax launch``) makes the script's
``tj.ElasticJob(...)`` build its own job (``tj.multihost.LaunchedJob``);
``ResourceTrace.load(path)`` reads a trace of device changes; ``replay(job, state, step, trace)``
drives a job through it; ``EventRecord`` is what ``job.records`` holds for every event (its
``EventKind``, ``Decision`` and ``Compilation``).
"""

from tenplex_jax._src.bitwise import use_flags as use_bitwise_flags
from tenplex_jax._src.elastic.core import JobOptions
from tenplex_jax._src.elastic.events import Compilation, Decision, EventKind, EventRecord
from tenplex_jax._src.elastic.job import use_job_class
from tenplex_jax._src.elastic.steps import enable_compilation_cache
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent, replay

__all__ = [
    "Compilation",
    "Decision",
    "EventKind",
    "EventRecord",
    "JobOptions",
    "ResourceTrace",
    "TraceEvent",
    "enable_compilation_cache",
    "replay",
    "use_bitwise_flags",
    "use_job_class",
]

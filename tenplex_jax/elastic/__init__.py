"""The elastic loop's parts beside :class:`tenplex_jax.ElasticJob`: its event records, resource
traces and their replay, and JAX's persistent compilation cache.

``ResourceTrace.load(path)`` reads a trace of device changes; ``replay(job, trace, ...)`` drives a
job through it; ``EventRecord`` is what ``job.records`` holds for every event.
"""

from tenplex_jax._src.elastic.events import EventRecord
from tenplex_jax._src.elastic.steps import enable_compilation_cache
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent, replay

__all__ = ["EventRecord", "ResourceTrace", "TraceEvent", "enable_compilation_cache", "replay"]

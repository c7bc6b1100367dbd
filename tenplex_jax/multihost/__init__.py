"""Many processes: the launcher (``tenplex-jax launch``, locally or on Ray) and the tensor stores.

JAX cannot change the process set of a running job, so a change of processes is a new generation
of them; the state that must outlive a generation lives in the tensor stores
(``tenplex_jax.multihost.store``), one per host slot. A script written for ``tj.ElasticJob`` runs
unchanged as a launched process: there its ``tj.ElasticJob(...)`` builds a :class:`LaunchedJob`
(``tj.elastic.use_job_class``). :class:`RunDir` reads what a run directory holds. Importing this
needs no JAX (``LaunchedJob`` loads on first use).
"""

from tenplex_jax._src.multihost.launch import Launcher, launch
from tenplex_jax._src.multihost.rundir import (
    FirstStep,
    LiveReport,
    RestoreReport,
    RunDir,
    RunEvent,
    Source,
)
from tenplex_jax._src.multihost.spec import JobSpec, LaunchOptions, Restore

__all__ = [
    "FirstStep",
    "JobSpec",
    "LaunchOptions",
    "LaunchedJob",
    "Launcher",
    "LiveReport",
    "Restore",
    "RestoreReport",
    "RunDir",
    "RunEvent",
    "Source",
    "launch",
]


def __getattr__(name: str):
    if name == "LaunchedJob":  # needs JAX, which the launcher does not import
        from tenplex_jax._src.multihost.launched import LaunchedJob

        return LaunchedJob
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Many processes: the launcher (``tenplex-jax launch``, locally or on Ray) and the tensor stores.

JAX cannot change the process set of a running job, so a change of processes is a new generation
of them; the state that must outlive a generation lives in the tensor stores
(``tenplex_jax.multihost.store``), one per host slot. A script written for ``tj.ElasticJob`` runs
unchanged as a launched process. Importing this needs no JAX.
"""

from tenplex_jax._src.multihost.launch import Launcher, launch
from tenplex_jax._src.multihost.spec import JobSpec, LaunchOptions

__all__ = ["JobSpec", "LaunchOptions", "Launcher", "launch"]

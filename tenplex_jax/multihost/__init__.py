"""Many processes: the launcher, the commit protocol and the tensor store.

JAX cannot change the process set of a running job, so a change of processes is a new *generation*
of them, and the state that must outlive a generation lives in tensor stores (one per host slot).

- ``launch.py``: ``tenplex-jax launch``, which starts the stores and the generations of a script;
- ``ray.py``: the same launcher with its stores and workers on the nodes of a Ray cluster
  (``tenplex-jax launch --ray``; Ray is imported only there);
- ``worker.py``: a launched process's side (joined by ``python -m tenplex_jax.multihost``, used by
  ``ElasticJob``): restore from the stores or the orbax tier, commit, planned ends;
- ``commit.py``: versions of a state in the stores, written and pulled shard by shard;
- ``store/``: the tensor store server, its client and ``ReplicatedStore``.

Only the launcher is imported here; it needs no JAX.
"""

from tenplex_jax.multihost.launch import JobSpec, Launcher, LaunchOptions, launch

__all__ = ["JobSpec", "LaunchOptions", "Launcher", "launch"]

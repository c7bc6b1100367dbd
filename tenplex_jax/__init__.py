"""tenplex_jax: device-independent JAX/Flax training state.

The public face, in the order a user meets it::

    import tenplex_jax as tj

    nodes = {"model": model, "optimizer": optimizer}            # any NNX model + optax state
    state = nnx.state(nodes)
    old = tj.PTC.of(state, rules, tj.ParallelConfig(data=8), jax.devices())
    state = tj.place(state, old)                                # lay the state out as `old`
    new = tj.PTC.of(state, rules, tj.ParallelConfig(data=2, tensor=2), jax.devices()[2:6])
    new = tj.allocate(old, new)                                 # device order that keeps most bytes
    plan = tj.make_plan(old, new)                               # pure: no device memory touched
    print(plan)                                                 # bytes kept / moved per group
    state, report = tj.reshard(state, plan)                     # bit-identical, old buffers freed
    nnx.update(nodes, state)

    dataset = tj.DatasetPTC(samples, global_batch=64, seed=0)  # the dataset PTC: a fixed order
    layout = tj.BatchLayout(64, ranks=new.config.data * new.config.fsdp, workers=8)
    grad_fn = tj.batch_value_and_grad(example_losses, layout, mesh)  # bitwise across DP sizes

    job = tj.ElasticJob(rules, dataset, workers=8)             # elastic training, your own loop
    state = job.place(state)
    step = job.jit(train_step)                                  # train_step(state, batch)
    with job.handle_sigterm():                                  # SIGTERM: shrink, commit, go on
        while job.step < 1000:
            state, batch = job.next(state)                      # events applied between steps
            state, metrics = step(state, batch)

    # a process of `tenplex-jax launch --nprocs 4 SCRIPT` (state in the tensor stores)
    job = tj.launch.join()                                      # jax.distributed on 127.0.0.1
    state, ptc, step = job.restore(abstract, rules, dataset, init=init)   # pulls its own shards
    if job.after_step(state, ptc, step, dataset): ...           # async commits; planned resize
"""

from tenplex_jax.checkpoint import (
    Restored,
    Saved,
    latest_checkpoint,
    restore_checkpoint,
    save_checkpoint,
)
from tenplex_jax.cluster import Cluster, DeviceType
from tenplex_jax.commit import CommitReport, PullReport
from tenplex_jax.data import REMAINDERS, BatchLayout, DatasetPTC, DataState
from tenplex_jax.elastic import ElasticJob, EventRecord
from tenplex_jax.errors import (
    CheckpointError,
    DataError,
    LayoutError,
    LostShardsError,
    PlanError,
    StoreError,
)
from tenplex_jax.job import Job, join
from tenplex_jax.launch import LaunchError, LaunchOptions
from tenplex_jax.pipeline import Stages, pipeline, restage
from tenplex_jax.plan import LeafPlan, Piece, Plan, ShardPlan, allocate, make_plan
from tenplex_jax.planner import Candidate, Choice, choose, estimate
from tenplex_jax.profile import LayerProfile, ModelProfile
from tenplex_jax.ptc import MESH_AXES, PTC, LeafLayout, ParallelConfig
from tenplex_jax.steps import Batch
from tenplex_jax.store import ObjectInfo, ReplicatedStore, StoreClient, StoreProcess
from tenplex_jax.train import batch_value_and_grad, device_batch
from tenplex_jax.transform import ReshardReport, place, reshard

__all__ = [
    "MESH_AXES",
    "PTC",
    "REMAINDERS",
    "Batch",
    "BatchLayout",
    "Candidate",
    "CheckpointError",
    "Choice",
    "Cluster",
    "CommitReport",
    "DataError",
    "DataState",
    "DatasetPTC",
    "DeviceType",
    "ElasticJob",
    "EventRecord",
    "Job",
    "LaunchError",
    "LaunchOptions",
    "LayerProfile",
    "LayoutError",
    "LeafLayout",
    "LeafPlan",
    "LostShardsError",
    "ModelProfile",
    "ObjectInfo",
    "ParallelConfig",
    "Piece",
    "Plan",
    "PlanError",
    "PullReport",
    "ReplicatedStore",
    "ReshardReport",
    "Restored",
    "Saved",
    "ShardPlan",
    "Stages",
    "StoreClient",
    "StoreError",
    "StoreProcess",
    "allocate",
    "batch_value_and_grad",
    "choose",
    "device_batch",
    "estimate",
    "join",
    "latest_checkpoint",
    "make_plan",
    "pipeline",
    "place",
    "reshard",
    "restage",
    "restore_checkpoint",
    "save_checkpoint",
]

"""``tenplex-jax launch``: run a training script as an elastic multi-process job
(``tj.multihost.launch``, or on a Ray cluster). Imports no JAX: the launcher needs none."""

from __future__ import annotations

import argparse
import pathlib
import sys

from tenplex_jax._src.cli.parsing import count, fields_of, positive

EXAMPLES = """\
examples:
  tenplex-jax launch --nprocs 4 --devices-per-proc 2 --commit-every 5 \\
      examples/elastic_gpt.py --steps 40
      4 processes x 2 CPU devices train the GPT (the script that also runs alone); kill one
      (kill -9 PID) and the job goes on with 3, its shards pulled from the replicas in the
      other stores
  echo 2 > RUN_DIR/resize
      a planned resize to 2 processes: commit (no lost steps), new generation
  kill -TERM LAUNCHER_PID
      graceful stop: commit (and orbax checkpoint with --checkpoint-dir), then exit
  tenplex-jax launch --ray auto --nprocs 3 --run-dir /shared/run examples/elastic_gpt.py
      the same script on a Ray cluster: one process and one tensor store per node; a node that
      dies ends the generation, a node that joins is grown onto when it pays
"""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a training script as an elastic multi-process job (stores, generations)",
        description="Start a tensor store per host slot and NPROCS worker processes of SCRIPT\n"
        "(jax.distributed on 127.0.0.1); when a worker dies, a resize is asked for\n"
        "(echo N > RUN_DIR/resize) or SIGTERM arrives, start the next generation, which\n"
        "pulls its shards from the stores. The script is an ordinary loop over\n"
        "tenplex_jax.ElasticJob, the same that runs in one process.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(command=run, name="launch")
    _processes(p.add_argument_group("processes"))
    _state(p.add_argument_group("the state: stores, commits, checkpoints"))
    _restarts(p.add_argument_group("restarts: what a new generation reuses"))
    ray = p.add_argument_group("on a Ray cluster")
    ray.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster (ADDRESS, or auto): a store per node, workers placed on the "
        "nodes, node deaths and joins handled (pip install 'tenplex_jax[ray]')",
    )
    ray.add_argument(
        "--ray-resource",
        metavar="NAME",
        help="with --ray: only nodes that offer this custom resource take part",
    )
    p.add_argument("script", metavar="SCRIPT", help="the training script (python file)")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")


def _processes(group) -> None:
    for flag, kind, default, what in (
        ("--nprocs", positive, 2, "worker processes"),
        ("--devices-per-proc", positive, 2, "CPU devices per process"),
        ("--max-restarts", count, 3, "failures survived"),
        ("--min-procs", positive, 1, "give up below this many"),
    ):
        group.add_argument(flag, type=kind, default=default, help=f"{what} (default: {default})")
    group.add_argument(
        "--run-dir", metavar="DIR", help="logs, events, control files (default: a temp folder)"
    )


def _state(group) -> None:
    group.add_argument(
        "--replicas",
        type=count,
        default=1,
        help="copies of each shard on the next hosts' stores besides the writer's (default: 1; "
        "0: a lost host's shards come from the orbax checkpoint)",
    )
    group.add_argument(
        "--commit-every", type=positive, default=10, help="steps between commits (default: 10)"
    )
    group.add_argument(
        "--checkpoint-dir", metavar="DIR", help="orbax checkpoints: the persistent tier"
    )
    group.add_argument(
        "--checkpoint-every",
        type=positive,
        help="steps between orbax checkpoints (default: only at a stop and at the end)",
    )
    group.add_argument(
        "--store-dir",
        metavar="DIR",
        help="the stores' disk tier (default: RUN_DIR/stores); on a tmpfs such as /dev/shm "
        "commits skip the disk's fsyncs",
    )


def _restarts(group) -> None:
    group.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="JAX's persistent compilation cache for every generation (on CPU it serves the "
        "init and one-process steps; multi-process gloo steps compile again)",
    )
    group.add_argument(
        "--no-executable-cache",
        dest="executables",
        action="store_false",
        help="compile every layout in every process (default: one process compiles a layout, "
        "the others and later generations load it from RUN_DIR/executables, and the layout "
        "after the loss of any one process is compiled ahead)",
    )
    group.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="start every process of a new generation cold (default: one warm standby process "
        "per slot, JAX and the script's imports loaded, takes the rank)",
    )
    group.add_argument(
        "--no-keep",
        dest="keep",
        action="store_false",
        help="end every process with its generation, as a plain restart does (default: the "
        "processes that stay keep running and join the next generation in place; the "
        "coordination service runs in the launcher)",
    )
    group.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="restore a failure's survivors from the last commit (default: from their memory "
        "at their last completed step, a live version, when every shard has a holder among "
        "them: no step lost)",
    )
    group.add_argument(
        "--central",
        action="store_true",
        help="Tenplex-Central, for comparisons: every commit goes to the first process's store "
        "alone, which serves every process's restore (default: each process writes its own "
        "shards to its own store and the next --replicas)",
    )
    group.add_argument(
        "--grace",
        type=float,
        default=0.0,
        help="with --no-keep: seconds survivors of a failure get before SIGKILL (default: 0; on "
        "CPU they hang in gloo collectives with the dead peer, which never time out)",
    )


def run(args) -> int:
    """Launch the job ``args`` describe; the launcher's exit status (2: bad options)."""
    from tenplex_jax._src.errors import LaunchError
    from tenplex_jax._src.multihost.launch import launch
    from tenplex_jax._src.multihost.spec import LaunchOptions

    given = fields_of(LaunchOptions, args) | {"args": tuple(args.args)}
    dirs = ("run_dir", "checkpoint_dir", "store_dir", "compile_cache")
    given |= {k: pathlib.Path(given[k]) for k in dirs if k in given}
    try:
        options = LaunchOptions(**given)
    except LaunchError as error:
        print(f"tenplex-jax launch: error: {error}", file=sys.stderr)
        return 2
    if args.ray:
        from tenplex_jax._src.multihost.ray import launch_on_ray

        return launch_on_ray(options, args.ray, resource=args.ray_resource)
    return launch(options)

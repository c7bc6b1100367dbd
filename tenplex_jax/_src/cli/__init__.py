"""The ``tenplex-jax`` command line: ``plan`` a reshard without devices, run the ``demo`` or
``bench``,
``launch`` a multi-process job, ``simulate`` a trace on a described cluster.

Heavy modules (JAX, Flax, the reference model ``tenplex_jax_models``) are imported inside the
subcommands:
``demo`` must set JAX's platform and CPU device count before any backend starts, and ``--help``
should not wait for them. Bad input (an unknown axis, an indivisible dim, a device list of the wrong
length) is reported with the library's own message and exit status 2, without a traceback, because
the message already names the leaf, shape, spec and mesh that broke the rule.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence

from tenplex_jax._src.cli import parsing

MODELS = ("tiny", "small", "gpt100m")
MIB = 2**20

PLAN_EXAMPLES = """\
examples:
  tenplex-jax plan --from data=8 --to data=2,tensor=2 --to-devices 2-5
      shrink from 8 data-parallel devices to a 2x2 data/tensor mesh on devices 2..5
  tenplex-jax plan --model gpt100m --from fsdp=4,tensor=2 --to data=2,fsdp=4 --leaves
      a 113M-parameter model: how many bytes a change of parallelism moves, per leaf group
  tenplex-jax plan --model tiny --from tensor=3 --to data=3 --allow-replicate
      replicate dims that 3 does not divide instead of refusing the config

  tenplex-jax plan --cluster meshes/hetpipe.toml --devices 8 --model gpt100m --batch 32
      the planner: the best (data, fsdp, tensor, pipe), microbatches and stage boundaries for the
      first 8 devices of a cluster description, with a table of the runners-up and rejections
  tenplex-jax plan --cluster meshes/cloud-mix.toml --objective cost --min-throughput 1000
      the devices to rent and the layout with the most samples per dollar at >= 1000 samples/s

No device is touched: the state is abstract (nnx.eval_shape) and devices are bare ids, so a plan for
any model and any device count is computed on a laptop in seconds.
"""

DEMO_EXAMPLES = """\
examples:
  tenplex-jax demo --out out/demo
      the mixture-of-experts GPT, 60 steps on 8 fake CPU devices, through every dimension:
      data=2,expert=4 on 8 -> expert=2,tensor=2 on 4 -> pipe=2,data=3 on 6 -> data=2,expert=4 on 8
  tenplex-jax demo --bitwise --out out/bitwise
      the small dense GPT resized 8 -> 4 -> 6 -> 8 (data and FSDP sizes the planner picks):
      params bit-identical to a run without resizes
  tenplex-jax demo --model small --schedule "0:data=8; 20:tensor=4; 40:pipe=2,fsdp=2"
      a schedule of your own: at each step, a layout over the model's axes
  tenplex-jax demo --bitwise --model tiny --steps 8 --schedule 2:4,4:6,6:8 --batch 12
      a quick run; batch 12 does not split over 8 devices, so the first layout adds tensor=2
  tenplex-jax demo --method device_put
      move the state with one jax.device_put instead of the per-shard plan executor
  tenplex-jax demo --wsp --out out/wsp
      heterogeneous virtual workers with wave synchronous parallel through a parameter server in
      the tensor stores; one dies at 30%, a new one joins at 50%; exactly once, loss.png
  tenplex-jax demo --wsp --cluster meshes/hetpipe.toml --out out/wsp-hetpipe
      the planner builds the virtual workers for a cluster (grouping, uneven stages, Nm, D) and
      the demo trains them on fake CPU devices slowed by their speed
  tenplex-jax demo --wsp --cluster meshes/hetpipe.toml --processes --out out/wsp-nodes
      the same with every VW in processes of its own, one per node it spans (HetPipe's equal
      grouping: a VW over two nodes runs in two processes, SPMD, its leader deciding for both)
  tenplex-jax demo --trace meshes/philly.toml --out out/trace
      replay a Philly-shaped resource trace (preemptions, a failure, offers) with the elastic
      loop; per-event table, goodput against checkpoint-restart, DIR/summary.json

Device sets: the run starts on devices 0..N-1; a shrink keeps the lowest-numbered current devices; a
grow takes the highest-numbered devices (4 on 0..3 grown to 6 runs on 2..7). Each resize prints its
plan; the end prints a table of resizes and writes DIR/loss.png and DIR/summary.json.
"""
MODEL_NAMES = MODELS + ("moe-tiny", "moe-small")


BENCH_EXAMPLES = """\
examples:
  tenplex-jax bench --out out/bench
      the full suite on the 114.5M-param GPT (about 10 minutes on 2 CPU cores)
  tenplex-jax bench --quick --out /tmp/bench
      the same rows on a small model and small sizes, without the recovery row: about a minute
  tenplex-jax bench --quick --recovery --out /tmp/bench
      with the recovery row (launched multi-process jobs, about a minute more)
  tenplex-jax bench --only reshard,stall --out /tmp/bench
      only the reshard matrix and the resize stall; the summary gives their goals
  tenplex-jax bench --quick --only reshard:mixed,recovery --out /tmp/bench
      one change of the matrix and the recovery row (named, it runs with --quick too)

Runs on 8 GPUs when the machine has them, else on 8 fake CPU devices. Writes DIR/results.json,
DIR/summary.md, DIR/reshard.png and DIR/plan_scaling.png (with --only: those of the rows run).
"""

LAUNCH_EXAMPLES = """\
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input) instead of exiting."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, or a usage error argparse has already printed
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 2
    from tenplex_jax._src.errors import DataError, LayoutError, PlanError

    try:
        return args.command(args)
    except (DataError, LayoutError, PlanError) as error:
        print(f"tenplex-jax {args.name}: error: {error}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tenplex-jax",
        description="Reshard a whole JAX/Flax NNX train state onto new devices with a minimal "
        "plan.",
    )
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    form = argparse.RawDescriptionHelpFormatter

    plan = sub.add_parser(
        "plan",
        help="print the reshard plan between two parallel configs (no devices needed)",
        description="Plan resharding the GPT train state (params, AdamW moments, counters) from\n"
        "one parallel config and device set to another; print what each leaf group\n"
        "keeps and moves.",
        epilog=PLAN_EXAMPLES,
        formatter_class=form,
    )
    plan.set_defaults(command=_plan, name="plan")
    plan.add_argument(
        "--model", choices=MODELS, default="small", help="GPT preset (default: small)"
    )
    for side, what in (("from", "source"), ("to", "target")):
        plan.add_argument(
            f"--{side}",
            dest=f"{side}_config",
            type=parsing.config,
            metavar="CONFIG",
            help=f"{what} parallel config as axis=size pairs over data, fsdp, tensor, pipe; "
            f"e.g. data=2,tensor=4 (axes left out have size 1)",
        )
        plan.add_argument(
            f"--{side}-devices",
            dest=f"{side}_devices",
            type=parsing.device_ids,
            metavar="IDS",
            help=f"{what} device ids in mesh order: 0-7, 2,3,4,5 or 2-7 (default: 0..n-1 for the "
            f"config's device count n)",
        )
    plan.add_argument(
        "--allow-replicate",
        action="store_true",
        help="replicate a dim that its mesh axes do not divide instead of refusing the config",
    )
    plan.add_argument(
        "--keep-order",
        action="store_true",
        help="use --to-devices in the given mesh order; by default tenplex_jax.allocate reorders "
        "them so that the most bytes stay on the device that holds them",
    )
    plan.add_argument(
        "--leaves", action="store_true", help="also print the target PTC: every leaf's shape, spec"
    )
    planner = plan.add_argument_group(
        "planner", "with --cluster, choose the layout instead of planning between two given ones"
    )
    planner.add_argument(
        "--cluster", metavar="FILE", help="cluster description (TOML, see meshes/)"
    )
    planner.add_argument(
        "--devices",
        type=parsing.positive,
        metavar="N",
        help="use the first N devices of the cluster (default: all of them)",
    )
    planner.add_argument(
        "--batch", type=parsing.positive, default=64, help="global batch in samples (default: 64)"
    )
    planner.add_argument(
        "--objective",
        choices=("time", "cost"),
        default="time",
        help="time: fastest step on all N devices (default); cost: most samples per dollar, "
        "choosing how many devices of each type to use",
    )
    planner.add_argument(
        "--min-throughput",
        type=float,
        default=0.0,
        metavar="SAMPLES_PER_S",
        help="with --objective cost: the slowest acceptable layout (default: 0)",
    )
    planner.add_argument(
        "--any-subset",
        action="store_true",
        help="with --objective time: also try leaving devices idle (per type: none, a power of "
        "two, or all); --objective cost always does",
    )
    planner.add_argument(
        "--top", type=parsing.positive, default=8, help="candidates shown in the table (default: 8)"
    )

    demo = sub.add_parser(
        "demo",
        help="train the GPT on fake CPU devices, resharding as the device count changes",
        description="Train the reference GPT on fake CPU devices and reshard the whole train\n"
        "state at the steps of a schedule; write a loss plot and a JSON summary.",
        epilog=DEMO_EXAMPLES,
        formatter_class=form,
    )
    demo.set_defaults(command=_demo, name="demo")
    demo.add_argument(
        "--out", default="out/demo", metavar="DIR", help="output folder (default: out/demo)"
    )
    demo.add_argument(
        "--model",
        choices=MODEL_NAMES,
        default=None,
        help="GPT preset (default: moe-small; small with --bitwise or --trace)",
    )
    demo.add_argument(
        "--steps",
        type=parsing.positive,
        default=None,
        help="training steps (default: 60; with --wsp, the run's minibatches, default 240)",
    )
    demo.add_argument(
        "--bitwise",
        action="store_true",
        help="the data-parallel schedule 15:4,30:6,45:8 on the small GPT: params bit-identical to "
        "a run without resizes",
    )
    demo.add_argument(
        "--schedule",
        type=_schedule,
        default=None,
        metavar="SCHEDULE",
        help="'STEP:N,...' moves the job onto N devices at each STEP (the planner picks the "
        "layout); 'STEP:axis=size,...; ...' onto that layout over the model's axes, a step-0 "
        "entry being the first (default: 0:data=2,expert=4; 15:expert=2,tensor=2; "
        "30:pipe=2,data=3; 45:data=2,expert=4 for the MoE GPT, 15:4,30:6,45:8 with --bitwise)",
    )
    demo.add_argument(
        "--batch",
        type=parsing.positive,
        default=24,
        help="global batch, the same on any device set (default: 24)",
    )
    demo.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    demo.add_argument(
        "--method",
        choices=("plan", "device_put"),
        default="plan",
        help="plan: the per-shard plan executor (default); device_put: one jax.device_put",
    )
    demo.add_argument(
        "--devices",
        type=parsing.positive,
        default=8,
        help="fake CPU devices; the run starts on all of them (default: 8)",
    )
    demo.add_argument("--seed", type=int, default=0, help="init and data seed (default: 0)")
    demo.add_argument(
        "--grad-units",
        type=parsing.count,
        default=8,
        metavar="V",
        help="gradient units; the global batch is always cut into V units whose "
        "gradients are summed in a fixed order, so results are bitwise equal on any data-parallel "
        "size; 0 for plain data parallelism (default: 8)",
    )
    demo.add_argument(
        "--notice",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long a preemption notice or a scheduled move leaves the job its devices: the "
        "change waits up to this long for its layout's step to compile, training on meanwhile "
        "(JobOptions.notice_seconds; default: 0, the next step boundary)",
    )
    demo.add_argument(
        "--executable-cache",
        metavar="DIR",
        help="keep every compiled step in DIR (JobOptions.executable_cache): a later run loads "
        "each layout compiled before instead of compiling it; 'none' compiles every time "
        "(default: OUT/executables)",
    )
    demo.add_argument(
        "--trace",
        metavar="FILE",
        help="replay a resource trace (TOML, see meshes/README.md) with the elastic loop: "
        "preemptions, failures and offers at its steps; its steps and devices replace --steps, "
        "--schedule and --devices",
    )
    demo.add_argument(
        "--wsp",
        action="store_true",
        help="asynchronous virtual workers (4+2+2 devices, one slower) with wave synchronous "
        "parallel through a parameter server; one dies at 30%% and a new one joins at 50%%",
    )
    demo.add_argument(
        "--cluster",
        metavar="FILE",
        help="with --wsp: let the planner build the virtual workers for this cluster (TOML, see "
        "meshes/; at most 8 devices, each a fake CPU device slowed by its speed)",
    )
    demo.add_argument(
        "--processes",
        action="store_true",
        help="with --wsp: run each virtual worker in processes of its own, one per node it "
        "spans (with --cluster: the file's nodes; else one process per VW)",
    )
    demo.add_argument(
        "--plan-model",
        choices=MODELS,
        default="gpt100m",
        help="with --wsp --cluster: the GPT preset the plan is made for; the demo trains "
        "--model's width with its depth (default: gpt100m)",
    )
    demo.add_argument(
        "--distance",
        type=parsing.count,
        default=1,
        help="with --wsp: the clock distance D (default: 1)",
    )
    demo.add_argument(
        "--slowdown",
        type=float,
        default=2.0,
        help="with --wsp: how many times slower the slow device type is (default: 2)",
    )
    demo.add_argument(
        "--no-compile-ahead",
        action="store_true",
        help="with --trace: compile each layout's step only when the job moves onto it",
    )
    demo.add_argument(
        "--samples",
        type=parsing.positive,
        default=1000,
        help="dataset size, in samples of seq_len + 1 bytes of the corpus (default: 1000)",
    )

    bench = sub.add_parser(
        "bench",
        help=(
            "run the benchmark suite: reshard vs orbax restart, bytes, bandwidth, memory, loop, "
            "plan"
        ),
        description="Measure tenplex_jax against orbax save + restore, gather to host and\n"
        "jax.device_put on a GPT + AdamW state; bytes vs the plan's minimum, bandwidth vs\n"
        "memcpy, peak memory, loop overhead and plan scaling. Ratios come from one run.",
        epilog=BENCH_EXAMPLES,
        formatter_class=form,
    )
    bench.set_defaults(command=_bench, name="bench")
    bench.add_argument(
        "--out", default="out/bench", metavar="DIR", help="output folder (default: out/bench)"
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="small model and sizes: under a minute; checks that every ratio is computed",
    )
    bench.add_argument(
        "--repeats",
        type=parsing.positive,
        default=None,
        help="timed runs per strategy after a warm-up (default: 5, or 3 with --quick)",
    )
    bench.add_argument(
        "--no-recovery",
        action="store_true",
        help="skip the recovery row (stores vs orbax restart; launched jobs, about a minute)",
    )
    bench.add_argument(
        "--recovery",
        action="store_true",
        help="run the recovery row with --quick too (a full run always does)",
    )
    bench.add_argument(
        "--only",
        type=_bench_rows,
        default=None,
        metavar="ROW[,ROW]",
        help="run only these rows: reshard, loop, stall, plan, store, recovery, or reshard:KIND "
        "for one change of the matrix (KIND: dp, tp, fsdp, pp, mixed, disjoint)",
    )

    launch = sub.add_parser(
        "launch",
        help=(
            "run a training script as an elastic multi-process job (stores, generations, recovery)"
        ),
        description="Start a tensor store per host slot and NPROCS worker processes of SCRIPT\n"
        "(jax.distributed on 127.0.0.1); when a worker dies, a resize is asked for\n"
        "(echo N > RUN_DIR/resize) or SIGTERM arrives, start the next generation, which\n"
        "pulls its shards from the stores. The script is an ordinary loop over\n"
        "tenplex_jax.ElasticJob, the same that runs in one process.",
        epilog=LAUNCH_EXAMPLES,
        formatter_class=form,
    )
    launch.set_defaults(command=_launch, name="launch")
    launch.add_argument(
        "--nprocs", type=parsing.positive, default=2, help="worker processes (default: 2)"
    )
    launch.add_argument(
        "--devices-per-proc",
        type=parsing.positive,
        default=2,
        help="CPU devices per process (default: 2)",
    )
    launch.add_argument(
        "--replicas",
        type=parsing.count,
        default=1,
        help="copies of each shard on the next hosts' stores besides the writer's (default: 1)",
    )
    launch.add_argument(
        "--commit-every",
        type=parsing.positive,
        default=10,
        help="steps between commits (default: 10)",
    )
    launch.add_argument(
        "--max-restarts", type=parsing.count, default=3, help="failures survived (default: 3)"
    )
    launch.add_argument(
        "--min-procs", type=parsing.positive, default=1, help="give up below this many (default: 1)"
    )
    launch.add_argument(
        "--run-dir", metavar="DIR", help="logs, events, control files (default: a temp folder)"
    )
    launch.add_argument(
        "--checkpoint-dir", metavar="DIR", help="orbax checkpoints: the persistent tier"
    )
    launch.add_argument(
        "--checkpoint-every",
        type=parsing.positive,
        default=None,
        help="steps between orbax checkpoints (default: only at a stop and at the end)",
    )
    launch.add_argument(
        "--store-dir",
        metavar="DIR",
        help="the stores' disk tier (default: RUN_DIR/stores); on a tmpfs such as /dev/shm "
        "commits skip the disk's fsyncs",
    )
    launch.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="JAX's persistent compilation cache for every generation (on CPU it serves the "
        "init and one-process steps; multi-process gloo steps compile again)",
    )
    launch.add_argument(
        "--recover-from",
        choices=("store", "checkpoint"),
        default="store",
        help="where a new generation restores from (default: store; checkpoint ignores the stores)",
    )
    launch.add_argument(
        "--grace",
        type=float,
        default=0.0,
        help="with --no-keep: seconds survivors of a failure get before SIGKILL (default: 0; on "
        "CPU they hang in gloo collectives with the dead peer, which never time out)",
    )
    launch.add_argument(
        "--no-executable-cache",
        dest="executables",
        action="store_false",
        help="compile every layout in every process (default: one process compiles a layout, "
        "the others and later generations load it from RUN_DIR/executables, and the layout "
        "after the loss of any one process is compiled ahead)",
    )
    launch.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="start every process of a new generation cold (default: one warm standby process "
        "per slot, JAX and the script's imports loaded, takes the rank)",
    )
    launch.add_argument(
        "--no-keep",
        dest="keep",
        action="store_false",
        help="end every process with its generation, as a plain restart does (default: the "
        "processes that stay keep running and join the next generation in place; the "
        "coordination service runs in the launcher)",
    )
    launch.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run on a Ray cluster (ADDRESS, or auto): a store per node, workers placed on the "
        "nodes, node deaths and joins handled (pip install 'tenplex_jax[ray]')",
    )
    launch.add_argument(
        "--ray-resource",
        metavar="NAME",
        help="with --ray: only nodes that offer this custom resource take part",
    )
    launch.add_argument("script", metavar="SCRIPT", help="the training script (python file)")
    launch.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments")

    from tenplex_jax._src.cli import simulate

    simulate.add_parser(sub)
    return parser


def _launch(args) -> int:
    import pathlib

    from tenplex_jax._src.errors import LaunchError
    from tenplex_jax._src.multihost.launch import launch
    from tenplex_jax._src.multihost.spec import LaunchOptions

    path = lambda p: None if p is None else pathlib.Path(p)
    try:
        options = LaunchOptions(
            args.script,
            tuple(args.args),
            nprocs=args.nprocs,
            devices_per_proc=args.devices_per_proc,
            replicas=args.replicas,
            commit_every=args.commit_every,
            max_restarts=args.max_restarts,
            min_procs=args.min_procs,
            run_dir=path(args.run_dir),
            checkpoint_dir=path(args.checkpoint_dir),
            checkpoint_every=args.checkpoint_every,
            store_dir=path(args.store_dir),
            compile_cache=path(args.compile_cache),
            recover_from=args.recover_from,
            grace=args.grace,
            standby=args.standby,
            keep=args.keep,
            executables=args.executables,
        )
    except LaunchError as error:
        print(f"tenplex-jax launch: error: {error}", file=sys.stderr)
        return 2
    if args.ray:
        from tenplex_jax._src.multihost.ray import launch_on_ray

        return launch_on_ray(options, args.ray, resource=args.ray_resource)
    return launch(options)


def _plan(args) -> int:
    """Plan between two configs of an abstract state: no backend starts, no memory is allocated."""
    if args.cluster:
        return _choose(args)
    if args.from_config is None or args.to_config is None:
        print("tenplex-jax plan: error: give --from and --to, or --cluster", file=sys.stderr)
        return 2
    from tenplex_jax._src.errors import LayoutError
    from tenplex_jax._src.plan import allocate, make_plan
    from tenplex_jax._src.ptc import PTC
    from tenplex_jax_models import LOGICAL_RULES, build_state, param_count

    tic = time.perf_counter()
    _, state, _ = build_state(args.model, lr=1e-3, abstract=True)
    ptcs = []
    for side, config, ids in (
        ("from", args.from_config, args.from_devices),
        ("to", args.to_config, args.to_devices),
    ):
        ids = tuple(range(config.num_devices)) if ids is None else ids
        if len(ids) != config.num_devices:
            raise LayoutError(
                f"config {config} needs {config.num_devices} devices, got {len(ids)} from "
                f"--{side}-devices {_ids_text(ids)}"
            )
        ptcs.append(PTC.of(state, LOGICAL_RULES, config, ids, allow_replicate=args.allow_replicate))
    src, dst = ptcs
    plan = make_plan(src, dst if args.keep_order else allocate(src, dst))
    seconds = time.perf_counter() - tic
    print(
        f"model {args.model}: {param_count(state):,} params; train state {len(plan.leaves)} "
        f"leaves, {plan.dst.nbytes / MIB:.3f} MiB (params, AdamW moments, counters)"
    )
    print(plan.summary())
    kinds = plan.kinds
    senders = plan.senders
    busiest = max(senders.items(), key=lambda kv: kv[1]) if senders else None
    print(
        f"totals: moved {plan.bytes_moved / MIB:.3f} MiB between devices "
        f"({plan.bytes_moved / max(plan.dst.nbytes, 1):.1%} of the state), kept "
        f"{plan.bytes_kept / MIB:.3f} MiB in place; shards "
        + ", ".join(f"{kinds[k]} {k}" for k in ("keep", "split", "move", "merge"))
        + (f"; busiest sender device {busiest[0]} ({busiest[1] / MIB:.3f} MiB)" if busiest else "")
        + f"; planned in {seconds:.2f} s"
    )
    if args.leaves:
        print(plan.dst)
    return 0


def _choose(args) -> int:
    """The planner's table for the GPT on (the first N devices of) a cluster description."""
    from tenplex_jax._src.planner.cluster import Cluster
    from tenplex_jax._src.planner.search import choose
    from tenplex_jax_models import profile_of

    cluster = Cluster.load(args.cluster)
    if args.devices is not None:
        cluster = cluster.take(args.devices)
    model = profile_of(args.model)
    choice = choose(
        cluster,
        model,
        args.batch,
        objective=args.objective,
        min_throughput=args.min_throughput,
        subsets=True if args.any_subset else None,
        top=args.top,
    )
    print(
        f"model gpt {args.model}: {model.num_layers} layers, {model.param_bytes / MIB:.1f} MiB of "
        f"params; global batch {args.batch}"
    )
    print(choice.table())
    best = choice.best
    print(
        f"chosen: {best.config} with {best.microbatches} microbatches"
        + (f", layers per stage {best.stages.layers}" if best.config.pipe > 1 else "")
        + f"; devices in mesh order {_ids_text(best.devices)}"
    )
    return 0


def _demo(args) -> int:
    """Configure JAX for fake CPU devices first, then run the demo and print its resize table."""
    import pathlib

    import jax

    trace = None
    if args.trace:
        from tenplex_jax._src.elastic.trace import ResourceTrace

        trace = ResourceTrace.load(args.trace)
        args.devices = trace.devices
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    except RuntimeError:  # a backend already runs (demo called in-process); use it if big enough
        if len(jax.devices()) < args.devices:
            print(
                f"tenplex-jax demo: error: JAX already started with {len(jax.devices())} devices; "
                f"the demo needs {args.devices} (run it in a fresh process)",
                file=sys.stderr,
            )
            return 2
    if args.wsp:
        from tenplex_jax._src.cli import wsp

        wsp.run(
            wsp.WSPOptions(
                out=pathlib.Path(args.out),
                model=args.model or "tiny",
                total=args.steps or wsp.WSPOptions.total,
                distance=args.distance,
                slowdown=args.slowdown,
                lr=args.lr,
                seed=args.seed,
                cluster=pathlib.Path(args.cluster) if args.cluster else None,
                plan_model=args.plan_model,
                processes=args.processes,
            )
        )
        return 0
    from tenplex_jax._src.cli import demo

    model = args.model or ("small" if args.bitwise or trace is not None else "moe-small")
    options = demo.DemoOptions(
        out=pathlib.Path(args.out),
        model=model,
        steps=args.steps or 60,
        schedule=args.schedule or (),
        bitwise=args.bitwise,
        batch=args.batch,
        lr=args.lr,
        method=args.method,
        devices=args.devices,
        seed=args.seed,
        grad_units=args.grad_units or None,
        samples=args.samples,
        notice_seconds=args.notice,
        executable_cache=_executable_cache(args.executable_cache, args.out),
    )
    if trace is not None:
        from tenplex_jax._src.cli import replay

        options = dataclasses.replace(options, steps=trace.steps, schedule=())
        summary = replay.run(options, trace, compile_ahead=not args.no_compile_ahead)
        print()
        print(replay.event_table(summary))
        print(demo.consistency_line(summary | {"epochs": summary["samples_seen"] / args.samples}))
        print(f"wrote {options.out / 'summary.json'}")
        return 0
    summary = demo.run(options)
    print()
    print(demo.resize_table(summary))
    print(demo.consistency_line(summary))
    print(f"wrote {options.out / 'loss.png'} and {options.out / 'summary.json'}")
    return 0


def _executable_cache(value: str | None, out: str):
    """The demo's ``--executable-cache``: DIR, ``none``, or by default OUT/executables."""
    import pathlib

    if value is None:
        return pathlib.Path(out) / "executables"
    return None if value.lower() == "none" else pathlib.Path(value)


def _bench(args) -> int:
    """Configure JAX (8 GPUs if present, else 8 fake CPU devices), then run the suite."""
    import pathlib

    from tenplex_jax_benchmarks import suite  # the benchmarks live outside the library

    if args.only is not None and args.no_recovery and "recovery" in args.only:
        print(
            "tenplex-jax bench: error: --only names the recovery row, --no-recovery skips it",
            file=sys.stderr,
        )
        return 2
    try:
        suite.configure_jax()
    except RuntimeError as error:
        print(f"tenplex-jax bench: error: {error}", file=sys.stderr)
        return 2
    options = suite.BenchOptions(
        out=pathlib.Path(args.out),
        quick=args.quick,
        repeats=args.repeats,
        recovery=not args.no_recovery and (args.recovery or not args.quick),
        only=args.only,
    )
    suite.run(options)
    return 0


def _bench_rows(text: str) -> tuple[str, ...]:
    from tenplex_jax_benchmarks.suite import parse_only  # stdlib imports only: cheap

    try:
        return parse_only(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _ids_text(ids: Sequence[int]) -> str:
    return ",".join(map(str, ids))


def _schedule(text: str) -> tuple[tuple[int, int], ...]:
    from tenplex_jax._src.cli.demo import parse_schedule

    try:
        return parse_schedule(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


if __name__ == "__main__":
    sys.exit(main())

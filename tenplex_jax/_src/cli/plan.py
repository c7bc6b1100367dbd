"""``tenplex-jax plan``: the reshard plan between two parallel configs of the reference GPT's
abstract train state, or with ``--cluster`` the planner's choice of layout; no device is touched."""

from __future__ import annotations

import argparse
import sys
import time

from tenplex_jax._src.cli import parsing

MIB = 2**20

EXAMPLES = """\
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


def add_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="print the reshard plan between two parallel configs (no devices needed)",
        description="Plan resharding the GPT train state (params, AdamW moments, counters) from\n"
        "one parallel config and device set to another; print what each leaf group\n"
        "keeps and moves.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.set_defaults(command=run, name="plan")
    plan.add_argument(
        "--model", choices=parsing.MODELS, default="small", help="GPT preset (default: small)"
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
    _add_planner_flags(
        plan.add_argument_group(
            "planner",
            "with --cluster, choose the layout instead of planning between two given ones",
        )
    )


def _add_planner_flags(planner) -> None:
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


def run(args) -> int:
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
    kinds, senders = plan.kinds, plan.senders
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


def _ids_text(ids) -> str:
    return ",".join(map(str, ids))

"""A virtual worker in a process of its own: ``python -m tenplex_jax.wsp --job MODULE:FUNCTION
--name NAME --devices K --stores ADDR,ADDR,... [--minibatches Nm] [--distance D] ...``.

``FUNCTION(devices, **options)`` (``--option key=value``, values read as JSON when they parse)
returns the job's parts: ``rules``, ``dataset``, ``init``, ``train_step``, ``config`` (a
``tj.ParallelConfig`` for ``K`` devices) and optionally ``grad_units``, ``stages`` and
``wave_step`` (the ``WorkerOptions`` of those names); ``--memory-limit BYTES`` and ``--prefetch``
are those options too. The process runs on ``K`` devices of its own
(fake CPU devices with ``--platform cpu``), trains until the run is done and appends each pushed
wave to ``--records`` as a JSON line; SIGTERM: it leaves at the next wave boundary. With ``--hold
FD`` it writes a line to ``FD`` once built and joins only when a line (or the end) comes on its
standard input (how ``tj.wsp.Processes`` starts the VWs added together at once). A VW over
``--processes P`` runs one per node (``--process I --coordinator HOST:PORT``: the VW's own
``jax.distributed`` job), ``K`` devices each; process 0 leads (:mod:`~tenplex_jax._src.wsp.group`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import pathlib
import signal
import sys
import threading
import time
import traceback


def main(argv=None) -> int:
    started = time.perf_counter()
    parser = _parser()
    args = parser.parse_args(argv)
    if args.processes > 1 and (args.coordinator is None or not 0 <= args.process < args.processes):
        parser.error("a VW of --processes P > 1 needs --coordinator and 0 <= --process < P")
    devices = _start_jax(args)
    from tenplex_jax._src.elastic.executables import ExecutableCache
    from tenplex_jax._src.wsp.group import Group

    module, _, function = args.job.partition(":")
    options = dict(_option(o) for o in args.option)
    parts = getattr(importlib.import_module(module), function)(len(devices), **options)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    group = Group.of_jax()
    executables = None if args.executables is None else ExecutableCache(args.executables)
    written = args.records is not None and group.leader
    records = open(args.records, "a") if written else None  # noqa: SIM115
    try:
        dropped = _train(args, parts, devices, group, executables, records, stop, started)
    except BaseException:
        if group.count == 1:
            raise
        # a process of a VW over several exits at once: JAX's exit would wait minutes at the
        # job's shutdown barrier for the others, blocked in the program this one left
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if records is not None:
        records.close()
    return 3 if dropped else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tenplex_jax.wsp", description=__doc__)
    parser.add_argument("--job", required=True, help="MODULE:FUNCTION giving the job's parts")
    parser.add_argument("--name", required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--stores", required=True, help="the stores' addresses, comma-separated")
    parser.add_argument("--token-file", default=None)
    parser.add_argument("--minibatches", type=int, default=1)
    parser.add_argument("--distance", type=int, default=0)
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument(
        "--memory-limit", type=int, default=None, help="bytes per device the VW may use"
    )
    parser.add_argument(
        "--prefetch", action="store_true", help="claim the next wave ahead and place its data"
    )
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--records", type=pathlib.Path, default=None)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--executables", type=pathlib.Path, default=None, help="a directory of compiled programs"
    )
    parser.add_argument("--processes", type=int, default=1, help="the VW's processes")
    parser.add_argument("--process", type=int, default=0, help="this one's index among them")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of the VW's service")
    parser.add_argument(
        "--hold", type=int, default=None, metavar="FD", help="say 'built' on FD, join on stdin's go"
    )
    return parser


def _start_jax(args) -> list:
    """JAX configured and started (the VW's own ``jax.distributed`` job when it spans
    processes); the VW's devices, over all of its processes."""
    import jax

    if args.platform == "cpu":  # before any backend starts
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.processes == 1:
        return jax.devices()[: args.devices]
    jax.distributed.initialize(  # the VW's own job; its service listens where it was told only
        args.coordinator,
        num_processes=args.processes,
        process_id=args.process,
        initialization_timeout=int(max(args.timeout, 60)),
        coordinator_bind_address=args.coordinator if args.process == 0 else None,
    )
    return jax.devices()


def _train(args, parts, devices, group, executables, records, stop, started) -> bool:
    """Build the VW, say so, wait for the runner's go (``--hold``), train until the run is done
    or ``stop`` is set; whether it was dropped."""
    from tenplex_jax._src.wsp.options import WorkerOptions
    from tenplex_jax._src.wsp.ps import ParameterServer
    from tenplex_jax._src.wsp.worker import VirtualWorker

    def write(record) -> None:
        if records is not None:
            records.write(json.dumps(dataclasses.asdict(record)) + "\n")
            records.flush()

    token = None if args.token_file is None else pathlib.Path(args.token_file).read_text().strip()
    options = WorkerOptions(
        minibatches=args.minibatches,
        distance=args.distance,
        slowdown=args.slowdown,
        timeout=args.timeout,
        grad_units=parts.get("grad_units"),
        on_record=write,
        stages=parts.get("stages"),
        wave_step=parts.get("wave_step"),
        executables=executables,
        group=group,
        memory_limit=args.memory_limit,
        prefetch=args.prefetch,
    )
    with ParameterServer(args.stores.split(","), token=token) as ps:
        worker = VirtualWorker(
            args.name,
            ps,
            parts["rules"],
            parts["dataset"],
            parts["init"],
            parts["train_step"],
            devices=devices,
            config=parts["config"],
            options=options,
        )
        # JAX imported, the state built, the step compiled or loaded: what a join waits for
        print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
        if args.hold is not None:
            with contextlib.suppress(OSError), os.fdopen(args.hold, "w") as built:
                built.write("built\n")  # (a runner gone meanwhile: the go below is its end)
            sys.stdin.readline()  # the runner's go; its end (the runner is gone) is one too
        worker.run(stop)
    print(f"memory: peak {worker.memory.peak} bytes per device ({worker.memory.source})")
    if executables is not None:
        executables.close()
        print(f"executables: {executables.hits} loaded, {executables.misses} compiled")
        for problem in executables.problems:
            print(f"executables: {problem}")
    return worker.dropped


def _option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--option takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


if __name__ == "__main__":
    sys.exit(main())

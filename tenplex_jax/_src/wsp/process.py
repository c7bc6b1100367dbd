"""A virtual worker in a process of its own: ``python -m tenplex_jax.wsp --job MODULE:FUNCTION
--name NAME --devices K --stores ADDR,ADDR,... [--minibatches Nm] [--distance D] ...``.

``FUNCTION(devices, **options)`` (``--option key=value``, values read as JSON when they parse)
returns the job's parts: ``rules``, ``dataset``, ``init``, ``train_step``, ``config`` (a
``tj.ParallelConfig`` for ``K`` devices) and optionally ``workers``, ``stages`` and ``wave_step``
(the VW's arguments of those names). The process runs on ``K``
devices of its own (fake CPU devices with ``--platform cpu``), joins the job's ledger, trains until
the run is done and appends each pushed wave to ``--records`` as a JSON line. SIGTERM: leave at the
next wave boundary.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import pathlib
import signal
import sys
import threading


def main(argv=None) -> int:
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
    parser.add_argument("--platform", default="cpu")
    parser.add_argument("--records", type=pathlib.Path, default=None)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)

    import jax

    if args.platform == "cpu":  # before any backend starts
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", args.devices)
    from tenplex_jax._src.wsp.ps import ParameterServer
    from tenplex_jax._src.wsp.worker import VirtualWorker

    module, _, function = args.job.partition(":")
    options = dict(_option(o) for o in args.option)
    parts = getattr(importlib.import_module(module), function)(args.devices, **options)
    token = None if args.token_file is None else pathlib.Path(args.token_file).read_text().strip()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    records = None if args.records is None else open(args.records, "a")  # noqa: SIM115

    def write(record) -> None:
        if records is not None:
            records.write(json.dumps(dataclasses.asdict(record)) + "\n")
            records.flush()

    with ParameterServer(args.stores.split(","), token=token) as ps:
        worker = VirtualWorker(
            args.name,
            ps,
            parts["rules"],
            parts["dataset"],
            parts["init"],
            parts["train_step"],
            devices=jax.devices()[: args.devices],
            config=parts["config"],
            minibatches=args.minibatches,
            distance=args.distance,
            slowdown=args.slowdown,
            timeout=args.timeout,
            workers=parts.get("workers"),
            on_record=write,
            stages=parts.get("stages"),
            wave_step=parts.get("wave_step"),
        )
        worker.run(stop)
    if records is not None:
        records.close()
    return 3 if worker.dropped else 0


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

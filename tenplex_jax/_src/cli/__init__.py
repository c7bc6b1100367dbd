"""The ``tenplex-jax`` command line: ``plan`` a reshard without devices, train through a schedule
(``demo``) or a resource trace (``replay``), ``launch`` a multi-process job, train HetPipe's virtual
workers (``wsp``), ``simulate`` a trace on a described cluster; and the commands installed packages
add (the repository's benchmarks add ``bench``).

Each command is a module with ``add_parser(sub)``: it adds its parser to the subparsers ``sub``
with ``set_defaults(command=RUN, name=NAME)``, ``RUN(args)`` returning the exit status. A package
adds a command by naming its ``add_parser`` in the entry-point group ``tenplex_jax.commands``.
Commands import JAX, Flax and the reference model inside ``RUN`` only: the demos must set JAX's
platform and CPU device count before any backend starts, and ``--help`` should not wait for them.
Bad input (an unknown axis, an indivisible dim, a device list of the wrong length) is reported
with the library's own message and exit status 2, without a traceback, because the message
already names the leaf, shape, spec and mesh that broke the rule.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Iterable, Sequence

COMMANDS = ("plan", "demo", "replay", "launch", "wsp", "simulate")  # modules of this package
GROUP = "tenplex_jax.commands"  # the entry points of the commands installed packages add


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input) instead of exiting."""
    argv = sys.argv[1:] if argv is None else argv
    # reading the entry points costs tens of ms: only for --help and the packages' commands
    ours = next((a for a in argv if not a.startswith("-")), None) in COMMANDS
    parser = build_parser(() if ours else installed())
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


def build_parser(added: Iterable[Callable] = ()) -> argparse.ArgumentParser:
    """The parser of the library's commands, then of each ``add_parser`` in ``added``."""
    parser = argparse.ArgumentParser(
        prog="tenplex-jax",
        description="Reshard a whole JAX/Flax NNX train state onto new devices with a minimal "
        "plan.",
    )
    sub = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").add_parser(sub)
    for add_parser in added:
        add_parser(sub)
    return parser


def installed() -> list[Callable]:
    """The ``add_parser`` of every command an installed package registers in :data:`GROUP`."""
    from importlib.metadata import entry_points

    loaded = []
    for point in entry_points(group=GROUP):
        try:
            loaded.append(point.load())
        except Exception as error:  # a broken package must not take the other commands down
            print(
                f"tenplex-jax: warning: command {point.name} ({point.value}): {error!r}",
                file=sys.stderr,
            )
    return loaded


if __name__ == "__main__":
    sys.exit(main())

"""What the commands share: argparse ``type=`` functions whose errors name the rule and the value
(argparse would hide a ``ValueError``'s message), and the flags of the commands that train the
reference GPT."""

from __future__ import annotations

import argparse
import dataclasses

MODELS = ("tiny", "small", "gpt100m")  # the dense GPT presets
MODEL_NAMES = (*MODELS, "moe-tiny", "moe-small")


def config(text: str):
    from tenplex_jax._src.ptc import ParallelConfig

    try:
        return ParallelConfig.parse(text)
    except ValueError as error:  # argparse would hide a ValueError's message
        raise argparse.ArgumentTypeError(str(error)) from None


def device_ids(text: str) -> tuple[int, ...]:
    """``"0-3,6,7"`` → ``(0, 1, 2, 3, 6, 7)``."""
    ids = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise argparse.ArgumentTypeError(
                f"device ids are 'a-b' ranges or ids separated by commas, such as 0-7 or 2,3,4,5; "
                f"got {text!r}"
            )
        ids.extend(range(int(lo), int(hi if sep else lo) + 1))
    if not ids:
        raise argparse.ArgumentTypeError(f"no device ids in {text!r}")
    return tuple(ids)


def positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def count(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def fields_of(cls, args: argparse.Namespace) -> dict:
    """The parsed flags that name a field of the dataclass ``cls``; a None one keeps its default."""
    names = {field.name for field in dataclasses.fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def add_training_flags(parser, *, out: str, model: str) -> None:
    """``--out`` (default ``out``), ``--model``, ``--lr`` and ``--seed``: the flags of every
    command that trains the reference GPT. ``--model`` defaults to None, for the command to
    choose; ``model`` is the default that ``--help`` names."""
    parser.add_argument("--out", default=out, metavar="DIR", help=f"output folder (default: {out})")
    parser.add_argument("--model", choices=MODEL_NAMES, help=f"GPT preset (default: {model})")
    parser.add_argument(
        "--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)"
    )
    parser.add_argument("--seed", type=int, default=0, help="init and data seed (default: 0)")


def add_job_flags(parser) -> None:
    """The flags of the commands that train with ``ElasticJob`` (``demo``, ``replay``): the
    global batch, the dataset, the gradient units and the ``JobOptions`` they set."""
    parser.add_argument(
        "--batch",
        type=positive,
        default=24,
        help="global batch, the same on any device set (default: 24)",
    )
    parser.add_argument(
        "--samples",
        type=positive,
        default=1000,
        help="dataset size, in samples of seq_len + 1 bytes of the corpus (default: 1000)",
    )
    parser.add_argument(
        "--grad-units",
        type=count,
        default=8,
        metavar="V",
        help="gradient units; the global batch is always cut into V units whose gradients are "
        "summed in a fixed order, so results are bitwise equal on any data-parallel size; 0 for "
        "plain data parallelism (default: 8)",
    )
    parser.add_argument(
        "--method",
        choices=("plan", "device_put"),
        default="plan",
        help="plan: the per-shard plan executor (default); device_put: one jax.device_put",
    )
    parser.add_argument(
        "--notice",
        dest="notice_seconds",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="how long a preemption notice or a scheduled move leaves the job its devices: the "
        "change waits up to this long for its layout's step to compile, training on meanwhile "
        "(JobOptions.notice_seconds; default: 0, the next step boundary)",
    )
    parser.add_argument(
        "--executable-cache",
        metavar="DIR",
        help="keep every compiled step in DIR (JobOptions.executable_cache): a later run loads "
        "each layout compiled before instead of compiling it; 'none' compiles every time "
        "(default: OUT/executables)",
    )

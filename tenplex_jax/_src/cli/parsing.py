"""The argument types the commands share: argparse ``type=`` functions whose errors name the rule
and the value (argparse would hide a ``ValueError``'s message)."""

from __future__ import annotations

import argparse


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

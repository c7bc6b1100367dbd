"""One checksum for every byte tenplex_jax stores: ``"crc32:<8 hex digits>"`` (zlib's crc32).

The tensor store checks it on every hop and on disk (objects and their headers), and in every
read through shared memory; a checkpoint step records it for every file it consists of.
:func:`crc32` is zlib-ng's: zlib's polynomial and values, with the SIMD kernels that zlib lacks
(9 against 2.7 GB/s on the project's 2-core machine), and it releases the GIL, so files are
checked on a thread each. This module needs neither JAX nor NumPy.

>>> of(b"tenplex")
'crc32:97d688b7'
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
from collections.abc import Iterable

from zlib_ng import zlib_ng

crc32 = zlib_ng.crc32  # crc32(data, running=0) -> int: zlib.crc32's signature and values

PREFIX = "crc32:"
CHUNK_BYTES = 8 << 20  # a file is read and checked this much at a time


def of(data, running: int = 0) -> str:
    """The checksum of a bytes-like object (continuing ``running``, a crc32 value)."""
    return text(crc32(data, running))


def text(crc: int) -> str:
    return f"{PREFIX}{crc & 0xFFFFFFFF:08x}"


def of_file(path: pathlib.Path) -> tuple[int, str]:
    """(size in bytes, checksum) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            crc, size = crc32(chunk, crc), size + len(chunk)
    return size, text(crc)


def of_files(root: pathlib.Path, names: Iterable[str]) -> dict[str, tuple[int, str] | None]:
    """``name`` (relative to ``root``) -> (size, checksum), or None for a file that is missing."""

    def one(name):
        try:
            return name, of_file(root / name)
        except FileNotFoundError:
            return name, None

    names = list(names)
    with concurrent.futures.ThreadPoolExecutor(min(len(names), os.cpu_count() or 1) or 1) as pool:
        return dict(pool.map(one, names))

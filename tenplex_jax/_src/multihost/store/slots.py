"""A JSON object's file: two slots written in place, one version each.

A compare-and-swap on a parameter server's ledger is answered at every push, so its file is
rewritten in place (``pwrite``) instead of being written anew and renamed over the old one: a
rename over an existing file costs a tenth of a millisecond or more on ext4 (it forces the new
file's blocks to be allocated), a write in place a few microseconds.

The file is ``2 * size`` bytes: slot 0 at offset 0, slot 1 at ``size``. A slot holds one record:
``b"TPXJ"`` + header length + the header's crc32 + a JSON header (path, version, nbytes, the
data's checksum, the ids of the last writes) + the data. A write goes to the slot that does not
hold the newest version, so the newest complete version survives a write torn by a crash of the
machine: a torn slot fails its header's crc32 or its data's checksum. A record that outgrows its
slot moves to a new file with larger slots (written to ``tmp/`` and renamed into place).

Files of the earlier format (one ``b"TPX2"`` record, ``tiers``' object files) are read as they
are, and replaced by a file of slots at their next write.
"""

from __future__ import annotations

import json
import os
import struct

from tenplex_jax._src import checksums
from tenplex_jax._src.multihost.store import wire

MAGIC = b"TPXJ"
PREFIX = struct.Struct("!4sII")  # magic, header bytes, header crc32
MIN_SLOT_BYTES = 4096  # a slot holds at least this much (a ledger with its write ids: ~3 KiB)


def record(header: dict, data) -> bytes:
    """One slot's record of ``header`` (``nbytes`` and ``checksum`` of ``data`` in it) and
    ``data``."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(MAGIC, len(encoded), checksums.crc32(encoded)) + encoded + bytes(data)


def slot_bytes(nbytes: int) -> int:
    """The slot size of a new file for a record of ``nbytes``: room to grow to twice that."""
    return max(MIN_SLOT_BYTES, 1 << (2 * nbytes - 1).bit_length())


def _record(fd: int, at: int, size: int) -> tuple[dict, bytes]:
    """The header and data of the record in the slot of ``size`` bytes at offset ``at`` of the
    open file ``fd``, read a part at a time (the slot's unused tail is never read);
    ``ValueError`` unless it is whole: its magic, its header's crc32, its size within the slot
    and its data's checksum."""
    prefix = os.pread(fd, PREFIX.size, at)
    if len(prefix) < PREFIX.size:
        raise ValueError(f"the slot ends within its record's first {PREFIX.size} bytes")
    magic, n, crc = PREFIX.unpack(prefix)
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r} (not a {MAGIC!r} record)")
    encoded = os.pread(fd, n, at + PREFIX.size) if n <= size - PREFIX.size else b""
    if len(encoded) != n or checksums.crc32(encoded) != crc:
        raise ValueError("the header fails its checksum (a torn or damaged write)")
    header = json.loads(encoded)
    if not isinstance(header, dict) or type(header.get("nbytes")) is not int:
        raise ValueError(f"a header is a JSON object with an integer nbytes, got {header!r:.200}")
    nbytes, start = header["nbytes"], PREFIX.size + n
    if not 0 <= nbytes <= size - start:
        raise ValueError(f"its header says {nbytes} bytes of data, more than the slot holds")
    data = os.pread(fd, nbytes, at + start)
    if len(data) != nbytes:
        raise ValueError(f"the file ends {len(data)} bytes into the record's {nbytes} of data")
    digest = wire.checksum(data)
    if digest != header.get("checksum"):
        raise ValueError(f"the data's checksum is {digest}, its header says {header['checksum']}")
    return header, data


def read(fd: int, slot: int | None = None) -> tuple[dict, bytes, int]:
    """The newest whole record of the open file of slots ``fd``, or with ``slot`` the record in
    that slot: (header, data, its slot). ``ValueError`` (naming each slot's fault) when there is
    none."""
    nbytes = os.fstat(fd).st_size
    if nbytes < 2 * MIN_SLOT_BYTES or nbytes % 2:
        raise ValueError(f"a file of slots is an even {2 * MIN_SLOT_BYTES}+ bytes, not {nbytes}")
    size = nbytes // 2
    found, faults = [], []
    for k in (0, 1) if slot is None else (slot,):
        try:
            header, data = _record(fd, k * size, size)
        except (ValueError, KeyError, TypeError, struct.error) as error:
            faults.append(f"slot {k}: {error}")
            continue
        found.append((int(header.get("version", 0)), k, header, data))
    if not found:
        raise ValueError("; ".join(faults))
    _, k, header, data = max(found, key=lambda f: f[0])
    return header, data, k


def write(fd: int, rec: bytes, slot: int, size: int, sync: bool) -> None:
    """Write ``rec`` into ``slot`` of the open file ``fd`` of slots of ``size`` bytes, whole
    (``pwrite`` may write less), and ``fdatasync`` it if ``sync``."""
    view, at = memoryview(rec), slot * size
    while view.nbytes:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n
    if sync:
        os.fdatasync(fd)

"""The tensor store's wire protocol and the records both ends share.

Every message is a frame: a fixed prefix ``!4sIQ`` (magic ``b"TPXS"``, header length, body
length), a UTF-8 JSON header, then ``body length`` raw bytes. No pickle: headers are JSON, arrays
travel as their raw C-order bytes, described by dtype name and shape in the header.

A connection opens with ``{"op": "hello", "token": ...}``; the server checks the token (when it
has one) with ``hmac.compare_digest`` before it reads anything else. A request with a body (``put``,
``put_json``) is answered first with ``{"ok": true, "continue": true}`` or an error: a request that
breaks a limit is refused before its body is sent, and the connection stays usable. A ``put``
whose header carries no checksum sends it after the body, in a trailer frame ``{"checksum": ...}``,
so that the client checksums each chunk as it sends it.

Every request after the hello carries a request id (``"rid"``) that each frame of its reply
echoes; a client tries a request again with the same id, and the store does it once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import struct
from typing import Any

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import checksums
from tenplex_jax._src.box import Box, Shape
from tenplex_jax._src.errors import StoreError, StoreProtocolError

MAGIC = b"TPXS"
PREFIX = struct.Struct("!4sIQ")  # magic, header bytes, body bytes
HELLO_HEADER_BYTES = 4096  # before the token is checked, the server reads no more than this
MAX_HEADER_BYTES = 64 << 10  # any request header (a put's: a path, a box, a shape, a dtype)
MAX_BESIDE = 256  # pushes a check may count beside its own (its header stays small)
MAX_SWAP_BYTES = 32 << 10  # a stage's swap: its JSON object, in the header (with the beside)
MAX_RESPONSE_HEADER_BYTES = 16 << 20
MAX_PATH_CHARS = 1024
MAX_DIMS = 32  # NumPy's own limit on a stored array's dims
MAX_JSON_BYTES = 64 << 20  # put_json / get_json objects
MAX_REPLY_BODY_BYTES = 1 << 30  # a client accepts no larger reply that is not an array it asked for
SMALL_BODY_BYTES = 64 << 10
CHUNK_BYTES = 64 << 20  # a socket timeout bounds the transfer of each chunk
DIGEST_CHUNK_BYTES = 1 << 20  # checksummed as sent: small enough to stay in cache


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One stored object: an array covering ``box`` of a global array of ``global_shape``.

    What ``StoreClient.put``, ``get(..., with_info=True)`` and ``list`` return.

    Attributes:
      path: the object's path.
      box: the block of the global array it covers (``tj.typing.Box``).
      global_shape: the global array's shape.
      dtype: its dtype's NumPy name (``"float32"``).
      nbytes: its bytes: the box's size times the itemsize.
      checksum: ``"crc32:<8 hex digits>"`` of the object's C-order bytes.
      clocks: for an array that ``accumulate`` updates (a parameter server's weights), how many
        pushes of each pusher it holds, as sorted ``(name, count)`` pairs; empty for any other
        object.
      sources: for such an array, the checksum of each pusher's last update added into it, as
        sorted ``(name, checksum)`` pairs: a pusher told its push was in already checks that
        the update in was its own.
    """

    path: str
    box: Box
    global_shape: Shape
    dtype: str
    nbytes: int
    checksum: str
    clocks: tuple[tuple[str, int], ...] = ()
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def shape(self) -> Shape:
        """The stored array's shape: the box's extent."""
        return boxes.shape(self.box)

    def to_json(self) -> dict:
        """The record as JSON, as the wire and a file's header carry it (``clocks`` as an object,
        only when not empty)."""
        return {
            "path": self.path,
            "box": boxes.to_json(self.box),
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
            "checksum": self.checksum,
        } | ({"clocks": dict(self.clocks), "sources": dict(self.sources)} if self.clocks else {})

    @classmethod
    def from_json(cls, obj: Any) -> ObjectInfo:
        """An object's record from a server's reply or a file's header, every field checked, so
        that no peer's claim is trusted unchecked.

        Args:
          obj: the JSON object :meth:`to_json` writes.

        Returns:
          The record.

        Raises:
          StoreError: a field is missing or wrong (a bad path, a box outside the global shape,
            a byte count that is not the box's size in the dtype, a checksum that is not a
            crc32); reason ``"protocol"``.
        """
        try:
            path, box = check_path(obj["path"]), as_box(obj["box"])
            global_shape, dtype = as_shape(obj["global_shape"]), dtype_of(str(obj["dtype"]))
            nbytes, digest = obj["nbytes"], obj["checksum"]
            check_box(path, box, global_shape)
            if type(nbytes) is not int or nbytes != nbytes_of(boxes.shape(box), dtype):
                raise StoreError(f"nbytes {nbytes!r} is not the box's size in {dtype.name}")
            if not isinstance(digest, str) or not digest.startswith(checksums.PREFIX):
                raise StoreError(f"checksum {digest!r:.100} is not a crc32")
            clocks = as_clocks(obj.get("clocks", {}))
            sources = obj.get("sources", {})
            if not isinstance(sources, dict) or not all(
                isinstance(v, str) and v.startswith(checksums.PREFIX) for v in sources.values()
            ):
                raise StoreError(f"sources {sources!r:.100} are not names to checksums")
            sources = tuple(sorted((check_name(k), v) for k, v in sources.items()))
        except (KeyError, TypeError, StoreError) as error:
            raise StoreError(
                f"an object record has a path, a box inside its global shape, a dtype, its byte "
                f"count and a checksum; got {obj!r:.300} ({error!r:.200})",
                "protocol",
            ) from None
        return cls(path, box, global_shape, dtype.name, nbytes, digest, clocks, sources)


MAX_NAME_CHARS = 128  # a pusher's name in an accumulate
MAX_RID_CHARS = 64  # a request id (the client sends 32 hex digits)


def check_name(name: Any) -> str:
    """A pusher's name: a non-empty printable string without '/' of at most MAX_NAME_CHARS."""
    if (
        not isinstance(name, str)
        or not 0 < len(name) <= MAX_NAME_CHARS
        or not name.isprintable()
        or "/" in name
    ):
        raise StoreError(
            f"a pusher's name is 1 to {MAX_NAME_CHARS} printable characters without "
            f"'/'; got {name!r:.200}"
        )
    return name


def as_clocks(value: Any) -> tuple[tuple[str, int], ...]:
    """``{name: count}`` (counts >= 0) as sorted pairs."""
    if not isinstance(value, dict) or len(value) > 1 << 16:
        raise StoreError(f"clocks are a JSON object of names to counts; got {value!r:.200}")
    for name, count in value.items():
        check_name(name)
        if not _is_int(count) or count < 0:
            raise StoreError(f"clock of {name!r} must be an integer >= 0, got {count!r:.50}")
    return tuple(sorted((str(k), int(v)) for k, v in value.items()))


def checksum(data) -> str:
    """``"crc32:<hex>"`` of a bytes-like object: ``tenplex_jax._src.checksums.of``."""
    return checksums.of(data)


def as_box(box: Any) -> Box:
    """A box from a sequence of (start, stop) integer pairs (JSON lists, tuples, NumPy ints; not
    floats or bools), ordered (start <= stop), at most ``MAX_DIMS`` dims; shape unchecked."""
    problem = None
    try:
        pairs = list(box)
        if len(pairs) > MAX_DIMS:
            problem = f"more than {MAX_DIMS} dims"
        elif not all(len(pair) == 2 and all(map(_is_int, pair)) for pair in pairs):
            problem = "an entry that is not an integer"
        else:
            out = boxes.parse(pairs)
            if any(stop < start for start, stop in out):
                problem = "a stop before its start"
    except (TypeError, ValueError):
        problem = "not a sequence of pairs"
    if problem is not None:
        raise StoreError(
            f"a box is a sequence of (start, stop) integer pairs with start <= stop, one per dim; "
            f"got {box!r:.200} ({problem})"
        )
    return out


def as_shape(shape: Any) -> Shape:
    """A global shape from a sequence of integers >= 0 (not floats or bools), at most
    ``MAX_DIMS`` of them."""
    try:
        dims = list(shape)
        valid = len(dims) <= MAX_DIMS and all(_is_int(n) and n >= 0 for n in dims)
    except TypeError:
        valid = False
    if not valid:
        raise StoreError(
            f"a global shape is a sequence of at most {MAX_DIMS} integers >= 0; got {shape!r:.200}"
        )
    return tuple(int(n) for n in dims)


def _is_int(value: Any) -> bool:
    """An integer, not a float or a bool (JSON's ``1.0`` and ``true`` are not dims or offsets)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_path(path: Any) -> str:
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\x00" in path:
        raise StoreError(
            f"a store path is a non-empty string of at most {MAX_PATH_CHARS} characters "
            f"without NUL; got {path!r:.200}"
        )
    try:
        path.encode()
    except UnicodeEncodeError:
        raise StoreError(f"a store path is valid UTF-8; got {path!r:.200}") from None
    return path


def check_box(path: str, box: Box, global_shape: Shape) -> None:
    """Every dim of ``box`` is a (start, stop) interval inside ``global_shape``."""
    if not boxes.within(box, global_shape):
        raise StoreError(
            f"a box must hold one (start, stop) with 0 <= start <= stop <= dim size per dim of "
            f"the global shape; got box={box} for global_shape={global_shape} at path {path!r}"
        )


def dtype_of(name: str) -> np.dtype:
    """A NumPy dtype from its name, including ml_dtypes' (``bfloat16``, ``float8_e4m3fn``, ...)."""
    import ml_dtypes  # registers its names with NumPy

    if not name.isidentifier() or name.startswith("_"):
        raise StoreError(f"unknown dtype name {name!r:.100}")
    try:
        dtype = np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError as error:
        raise StoreError(f"unknown dtype name {name!r}") from error
    if (
        not name.isidentifier()
        or name.startswith("_")
        or dtype.hasobject
        or dtype.fields is not None
        or dtype.name != name
        or dtype.itemsize == 0  # str, bytes, void: an object of any size in no bytes
        or dtype.kind not in "biufcV"
        or (dtype.kind == "V" and not hasattr(ml_dtypes, name))  # raw void: only ml_dtypes'
    ):
        raise StoreError(f"the store holds plain numeric arrays; dtype {name!r} is not one")
    return dtype


def as_bytes(array: np.ndarray) -> memoryview:
    """The C-order bytes of a contiguous array as a flat byte view (no copy; any dtype, 0-d too)."""
    return memoryview(array.reshape(-1).view(np.uint8))


# ---------------------------------------------------------------------------------------------
# framing


def send_frame(sock: socket.socket, header: dict, body=None) -> None:
    """Send a prefix + header, then ``body`` (a bytes-like object) if given."""
    data = json.dumps(header, separators=(",", ":")).encode()
    nbody = 0 if body is None else memoryview(body).nbytes
    frame = PREFIX.pack(MAGIC, len(data), nbody) + data
    if 0 < nbody <= SMALL_BODY_BYTES:  # one segment for small replies
        sock.sendall(frame + bytes(body))
        return
    sock.sendall(frame)
    if nbody:
        send_body(sock, body)


def send_body(sock: socket.socket, body, *, digest: bool = False) -> str | None:
    """``sendall`` in chunks: a socket's timeout bounds each chunk, not the whole body. With
    ``digest``, the body's checksum, computed on each chunk as it is sent (while it is in cache).
    ``body`` is bytes-like, or a list of them sent one after another as one body (no copy)."""
    step = DIGEST_CHUNK_BYTES if digest else CHUNK_BYTES
    crc = 0
    for part in body if isinstance(body, list) else [body]:
        view = memoryview(part).cast("B")
        for start in range(0, view.nbytes, step):
            chunk = view[start : start + step]
            if digest:
                crc = checksums.crc32(chunk, crc)
            sock.sendall(chunk)
    return checksums.text(crc) if digest else None


def send_header(sock: socket.socket, header: dict, body_bytes: int) -> None:
    """Send a prefix + header announcing ``body_bytes``; the body follows separately."""
    data = json.dumps(header, separators=(",", ":")).encode()
    if len(data) > MAX_HEADER_BYTES:
        raise StoreError(
            f"a request header is at most {MAX_HEADER_BYTES} bytes; this one is {len(data)} "
            f"({header.get('op')!r} of {str(header.get('path'))!r:.200})"
        )
    sock.sendall(PREFIX.pack(MAGIC, len(data), body_bytes) + data)


def recv_into(
    sock: socket.socket, view: memoryview, *, digest: bool = False, progress=None
) -> str | None:
    """Fill ``view`` from the socket; ``ConnectionError`` if the peer closes first. With
    ``digest``, the checksum of the bytes, computed chunk by chunk as they arrive (cache-hot);
    ``progress(bytes so far)`` after each chunk."""
    view = view.cast("B") if view.format != "B" else view
    got, n, crc = 0, view.nbytes, 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 24))
        if k == 0:
            raise ConnectionError(f"connection closed after {got} of {n} bytes")
        if digest:
            crc = checksums.crc32(view[got : got + k], crc)
        got += k
        if progress is not None:
            progress(got)
    return checksums.text(crc) if digest else None


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes (for headers and small bodies)."""
    buf = bytearray(n)
    if n:
        recv_into(sock, memoryview(buf))
    return buf


def recv_body(sock: socket.socket, n: int, progress=None) -> tuple[np.ndarray, str]:
    """``n`` bytes into a new uint8 array (not zero-filled first), and their checksum."""
    buf = np.empty(n, np.uint8)
    return buf, recv_into(sock, memoryview(buf), digest=True, progress=progress)


def recv_prefix(sock: socket.socket) -> tuple[int, int] | None:
    """(header bytes, body bytes) of the next frame; None on a clean close between frames."""
    first = sock.recv(PREFIX.size)
    if not first:
        return None
    buf = bytearray(first)
    if len(buf) < PREFIX.size:
        buf += recv_exact(sock, PREFIX.size - len(buf))
    return _unpack_prefix(buf)


def _unpack_prefix(buf) -> tuple[int, int]:
    magic, nheader, nbody = PREFIX.unpack(bytes(buf))
    if magic != MAGIC:
        raise StoreProtocolError(f"not a tenplex_jax store frame (magic {magic!r})")
    return nheader, nbody


def recv_header(sock: socket.socket, nheader: int, limit: int) -> dict:
    if nheader > limit:
        raise StoreProtocolError(f"a header is at most {limit} bytes; got one of {nheader} bytes")
    return _parse_header(recv_exact(sock, nheader))


def unique_keys(pairs: list) -> dict:
    """``json.loads``'s ``object_pairs_hook``: an object with a key twice is not plain JSON (a
    reader could take either value)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {twice!r:.100} appears twice in one object")
    return obj


def _parse_header(encoded) -> dict:
    try:
        header = json.loads(encoded, object_pairs_hook=unique_keys)
    except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, too deep, huge integers
        raise StoreProtocolError(f"a frame header must be UTF-8 JSON: {error!r:.300}") from None
    if not isinstance(header, dict):
        raise StoreProtocolError(f"a frame header must be a JSON object; got {type(header)}")
    return header


def nbytes_of(shape: Shape, dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize

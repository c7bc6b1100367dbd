"""The tensor store's transport under three server designs: threads (what the store runs) against
asyncio, measured in one run.

Each design serves the store's hot path over TCP on 127.0.0.1: receive a body of ``--mib`` MiB
into a preallocated buffer while computing its crc32 chunk by chunk (a put), or send one (a get),
then a small reply. The designs: blocking sockets with a thread per connection (``threads``),
asyncio with a ``BufferedProtocol`` receiving straight into the buffer (``asyncio-buffered``), and
asyncio streams (``asyncio-streams``: ``readexactly`` then a copy). One client and ``--clients``
concurrent clients, taking turns; the rates are GB/s of body bytes.

    python -m tenplex_jax_benchmarks.store_transport [--mib 64] [--rounds 5] [--clients 4]
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import struct
import sys
import threading
import time
import zlib

HEAD = struct.Struct("!cQ")  # b"P" put / b"G" get, body bytes
CHUNK = 1 << 20


def _threads_server(sock: socket.socket, stop: threading.Event) -> None:
    def serve(conn: socket.socket) -> None:
        with conn:
            buf = bytearray()
            while True:
                head = _recv_exact(conn, HEAD.size)
                if head is None:
                    return
                op, n = HEAD.unpack(head)
                if len(buf) < n:
                    buf = bytearray(n)
                view = memoryview(buf)[:n]
                if op == b"P":
                    got, crc = 0, 0
                    while got < n:
                        k = conn.recv_into(view[got:], min(n - got, CHUNK))
                        crc = zlib.crc32(view[got : got + k], crc)
                        got += k
                    conn.sendall(struct.pack("!I", crc))
                else:
                    for start in range(0, n, CHUNK):
                        conn.sendall(view[start : start + CHUNK])

    sock.settimeout(0.2)
    while not stop.is_set():
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


class _Buffered(asyncio.BufferedProtocol):
    """Receives a put's body straight into a preallocated buffer, checksummed as it lands."""

    def connection_made(self, transport):
        self.transport, self.head, self.body, self.need, self.crc = transport, b"", None, 0, 0
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.store = bytearray()

    def get_buffer(self, sizehint):
        if self.body is None:
            return memoryview(self.small)[: HEAD.size - len(self.head)]
        return self.body[self.got : min(self.need, self.got + CHUNK)]

    small = bytearray(HEAD.size)

    def buffer_updated(self, nbytes):
        if self.body is None:
            self.head += bytes(self.small[:nbytes])
            if len(self.head) < HEAD.size:
                return
            op, n = HEAD.unpack(self.head)
            self.head = b""
            if len(self.store) < n:
                self.store = bytearray(n)
            if op == b"G":
                view = memoryview(self.store)[:n]
                for start in range(0, n, CHUNK):
                    self.transport.write(view[start : start + CHUNK])
                return
            self.body, self.need, self.got, self.crc = memoryview(self.store)[:n], n, 0, 0
            return
        self.crc = zlib.crc32(self.body[self.got : self.got + nbytes], self.crc)
        self.got += nbytes
        if self.got == self.need:
            self.transport.write(struct.pack("!I", self.crc))
            self.body = None


async def _streams_serve(reader, writer):
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    store = bytearray()
    try:
        while True:
            op, n = HEAD.unpack(await reader.readexactly(HEAD.size))
            if len(store) < n:
                store = bytearray(n)
            if op == b"P":
                crc, got = 0, 0
                while got < n:
                    chunk = await reader.read(min(n - got, CHUNK))
                    store[got : got + len(chunk)] = chunk
                    crc = zlib.crc32(chunk, crc)
                    got += len(chunk)
                writer.write(struct.pack("!I", crc))
            else:
                view = memoryview(store)[:n]
                for start in range(0, n, CHUNK):
                    writer.write(view[start : start + CHUNK])
                    await writer.drain()
            await writer.drain()
    except asyncio.IncompleteReadError:
        writer.close()


def _asyncio_server(sock: socket.socket, stop: threading.Event, buffered: bool) -> None:
    async def main():
        loop = asyncio.get_running_loop()
        if buffered:
            server = await loop.create_server(_Buffered, sock=sock)
        else:
            server = await asyncio.start_server(_streams_serve, sock=sock)
        async with server:
            while not stop.is_set():
                await asyncio.sleep(0.05)

    asyncio.run(main())


def _recv_exact(conn, n):
    buf, got = bytearray(n), 0
    while got < n:
        k = conn.recv_into(memoryview(buf)[got:])
        if not k:
            return None
        got += k
    return bytes(buf)


def _client(port: int, nbytes: int, rounds: int, results: list) -> None:
    body = bytes(nbytes)
    sink = bytearray(nbytes)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            tic = time.perf_counter()
            conn.sendall(HEAD.pack(b"P", nbytes))
            view = memoryview(body)
            for start in range(0, nbytes, CHUNK):
                conn.sendall(view[start : start + CHUNK])
            assert struct.unpack("!I", _recv_exact(conn, 4))[0] == zlib.crc32(body)
            put = time.perf_counter() - tic
            tic = time.perf_counter()
            conn.sendall(HEAD.pack(b"G", nbytes))
            got, out = 0, memoryview(sink)
            while got < nbytes:
                got += conn.recv_into(out[got:], nbytes - got)
            results.append((put, time.perf_counter() - tic))


DESIGNS = {
    "threads": _threads_server,
    "asyncio-buffered": lambda s, e: _asyncio_server(s, e, True),
    "asyncio-streams": lambda s, e: _asyncio_server(s, e, False),
}


def measure(design: str, nbytes: int, rounds: int, clients: int) -> dict:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    stop = threading.Event()
    server = threading.Thread(target=DESIGNS[design], args=(sock, stop), daemon=True)
    server.start()
    results: list = []
    workers = [
        threading.Thread(target=_client, args=(sock.getsockname()[1], nbytes, rounds, results))
        for _ in range(clients)
    ]
    tic = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - tic
    stop.set()
    server.join(5)
    sock.close()
    return {
        "put_gbps": nbytes / statistics.median(r[0] for r in results) / 1e9,
        "get_gbps": nbytes / statistics.median(r[1] for r in results) / 1e9,
        "aggregate_gbps": 2 * nbytes * rounds * clients / wall / 1e9,
    }


def run_store_transport(mib: int = 64, rounds: int = 5, clients: int = 4, log=print) -> dict:
    nbytes = mib << 20
    runs: dict = {d: {1: [], clients: []} for d in DESIGNS}
    for _ in range(2):  # the designs take turns
        for design in DESIGNS:
            for n in (1, clients):
                runs[design][n].append(measure(design, nbytes, rounds, n))
    table = {
        design: {
            n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in by_n.items()
        }
        for design, by_n in runs.items()
    }
    for design, by_n in table.items():
        log(
            f"  {design:17s} "
            + "  ".join(
                f"{n} client{'s' if n > 1 else ''}: put {m['put_gbps']:5.2f} get "
                f"{m['get_gbps']:5.2f} "
                f"all {m['aggregate_gbps']:5.2f} GB/s"
                for n, m in by_n.items()
            )
        )
    return {
        "kind": "store_transport",
        "mib": mib,
        "rounds": rounds,
        "clients": clients,
        "gbps": table,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    run_store_transport(args.mib, args.rounds, args.clients)
    return 0


if __name__ == "__main__":
    sys.exit(main())

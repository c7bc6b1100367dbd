"""``StoreProcess``: a store server subprocess, started and waited for until it listens."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

from tenplex_jax._src.errors import StoreError


class StoreProcess:
    """A store server subprocess: ``StoreProcess.start(dir)`` waits until it listens.

    ``address`` is its "host:port" (``unix_address`` its "unix:PATH" when started with
    ``unix_socket``); ``pid`` and ``popen`` identify the child; ``stop()`` sends
    SIGTERM (the server writes what is only in memory to disk) and waits; ``kill()`` SIGKILLs.
    """

    def __init__(
        self,
        popen: subprocess.Popen,
        address: str,
        directory: pathlib.Path,
        unix_address: str | None = None,
    ):
        self.popen, self.address, self.dir = popen, address, directory
        self.unix_address = unix_address

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(
        cls,
        directory,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        memory_bytes: int | None = None,
        max_body_bytes: int | None = None,
        token_file=None,
        unix_socket=None,
        timeout: float = 60.0,
        stderr=None,
        args: tuple[str, ...] = (),
    ) -> StoreProcess:
        """Start a server on ``directory``; ``args`` are more of its command-line options (e.g.
        ``("--max-connections", "8")``)."""
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ready = directory.parent / f".{directory.name}.ready.{os.getpid()}.{time.monotonic_ns()}"
        ready.unlink(missing_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "tenplex_jax.multihost.store",
            "--dir",
            str(directory),
            "--host",
            host,
            "--port",
            str(port),
            "--ready-file",
            str(ready),
        ]
        if memory_bytes is not None:
            cmd += ["--memory-bytes", str(memory_bytes)]
        if max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(max_body_bytes)]
        if token_file is not None:
            cmd += ["--token-file", str(token_file)]
        if unix_socket is not None:
            cmd += ["--unix-socket", str(unix_socket)]
        cmd += [str(a) for a in args]
        # the server runs the same tenplex_jax as this process, wherever the caller's cwd is
        root = str(pathlib.Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=stderr, env=env)
        deadline = time.monotonic() + timeout
        try:
            while not ready.exists():
                if popen.poll() is not None:
                    raise StoreError(
                        f"the store server for {directory} exited with {popen.returncode} "
                        f"before listening: {' '.join(cmd)}"
                    )
                if time.monotonic() > deadline:
                    raise StoreError(
                        f"the store server for {directory} did not listen in "
                        f"{timeout} s: {' '.join(cmd)}"
                    )
                time.sleep(0.02)
            address = ready.read_text().strip()
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        finally:
            ready.unlink(missing_ok=True)
        unix_address = None if unix_socket is None else f"unix:{unix_socket}"
        return cls(popen, address, directory, unix_address)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout``); the exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()

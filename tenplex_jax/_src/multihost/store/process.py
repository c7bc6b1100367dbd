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

    Made by :meth:`start`; the constructor records a child that is already listening.
    ``stop()`` sends SIGTERM (the server writes what is only in memory to disk) and waits;
    ``kill()`` SIGKILLs. Example::

        proc = StoreProcess.start("/tmp/store0")
        with StoreClient(proc.address) as store:
            store.put("w", np.ones((4, 4), np.float32))
        proc.stop()

    Args:
      popen: the child process (kept as ``popen``).
      address: its ``"host:port"`` (kept as ``address``).
      directory: its disk tier (kept as ``dir``).
      unix_address: its ``"unix:PATH"`` when it also serves on a Unix socket (kept as
        ``unix_address``).
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
        """The child's process id."""
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
        """Start a server (``python -m tenplex_jax.multihost.store``), returned once it listens.

        Args:
          directory: its disk tier (created if missing).
          host: the address to bind.
          port: the port (0: any free port; ``address`` says which).
          memory_bytes: the memory tier's size (default: the server's).
          max_body_bytes: the largest request body it accepts (default: the server's).
          token_file: a file holding the secret clients must present (``token=``).
          unix_socket: a path to serve on as well (``unix_address``).
          timeout: seconds to wait for it to listen.
          stderr: where its stderr goes (a file or ``subprocess`` constant; default: ours).
          args: more of its command-line options (e.g. ``("--max-connections", "8")``).

        Raises:
          StoreError: it exited before listening or did not listen within ``timeout`` (it is
            killed); the message holds its command line.
        """
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ready = directory.parent / f".{directory.name}.ready.{os.getpid()}.{time.monotonic_ns()}"
        ready.unlink(missing_ok=True)
        options = {
            "--host": host,
            "--port": port,
            "--ready-file": ready,
            "--memory-bytes": memory_bytes,
            "--max-body-bytes": max_body_bytes,
            "--token-file": token_file,
            "--unix-socket": unix_socket,
        }
        cmd = [sys.executable, "-m", "tenplex_jax.multihost.store", "--dir", str(directory)]
        cmd += [str(a) for k, v in options.items() if v is not None for a in (k, v)]
        cmd += [str(a) for a in args]
        # the server runs the same tenplex_jax as this process, wherever the caller's cwd is
        paths = (str(pathlib.Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH"))
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, paths))}
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=stderr, env=env)
        try:
            address = _listening(popen, ready, timeout, f"for {directory}: {' '.join(cmd)}")
        finally:
            ready.unlink(missing_ok=True)
        unix_address = None if unix_socket is None else f"unix:{unix_socket}"
        return cls(popen, address, directory, unix_address)

    def stop(self, timeout: float = 30.0) -> int:
        """Stop the server: SIGTERM (it writes what is only in memory to disk), then wait.

        Args:
          timeout: seconds to wait before SIGKILL.

        Returns:
          Its exit code.
        """
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL the server (what is only in its memory tier is lost) and reap it; its exit
        code."""
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()


def _listening(popen: subprocess.Popen, ready: pathlib.Path, timeout: float, what: str) -> str:
    """The address a starting server writes to ``ready`` once it listens; ``StoreError`` (the
    server killed) when it exits first or takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            if popen.poll() is not None:
                raise StoreError(
                    f"the store server exited with {popen.returncode} before listening, {what}"
                )
            if time.monotonic() > deadline:
                raise StoreError(f"the store server did not listen in {timeout} s, {what}")
            time.sleep(0.02)
        return ready.read_text().strip()
    except BaseException:
        popen.kill()
        popen.wait()
        raise

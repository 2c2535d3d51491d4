"""A real ``redis-server`` on a free local port, started and stopped by the code that needs it.

For tests and demos: no fake Redis. The server is the system package (``apt-get install -y
redis-server``; ``scripts/setup_venv.sh`` installs it when absent and it can). It keeps nothing
on disk (no RDB, no AOF) and listens on 127.0.0.1 only.
"""

from __future__ import annotations

import shutil
import subprocess
from types import TracebackType
from typing import Any

from ..distributed import find_free_port
from ..errors import MissingDependencyError, RedisUnavailableError, RolloutSyncError
from .processes import ServerOutput, stop_process

__all__ = ["RedisServer", "RedisUnavailableError", "require_redis_server"]


def require_redis_server() -> str:
    """The ``redis-server`` executable's path.

    Raises:
        MissingDependencyError: it is not installed (``package="redis-server"``), or the
            ``redis`` client is not (``package="redis"``). ``RedisUnavailableError`` is
            the same class.
    """
    path = shutil.which("redis-server")
    if path is None:
        raise MissingDependencyError(
            "redis-server is not installed: apt-get install -y redis-server (./run_test.sh and "
            "./run.sh install it when run as root)",
            package="redis-server",
        )
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            "the redis client is not installed", package="redis", extra="fast-llm"
        ) from exc
    return path


class RedisServer:
    """``with RedisServer() as server:`` runs one on ``server.port`` until the block ends.

    :meth:`start` waits (up to ``timeout_s``) until it prints that it accepts connections;
    :meth:`stop` shuts it down
    (killing it after ``timeout_s``); :meth:`restart` does both on the same port, losing every
    stream (nothing is persisted).
    """

    def __init__(self, port: int | None = None, *, timeout_s: float = 15.0) -> None:
        self.executable = require_redis_server()
        self.port = port if port is not None else find_free_port()
        self.timeout_s = timeout_s
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        """A ``redis.Redis`` client of this server (socket timeouts default to ``timeout_s``)."""
        import redis

        kwargs.setdefault("socket_timeout", self.timeout_s)
        kwargs.setdefault("socket_connect_timeout", self.timeout_s)
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def start(self) -> None:
        """Start the server and wait until it prints that it accepts connections.

        Raises:
            RolloutSyncError: it exited, or was not ready within ``timeout_s``.
        """
        if self._process is not None:
            return
        self._process = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        output = ServerOutput(self._process, "Ready to accept connections")
        try:
            output.wait_ready(self.timeout_s, f"redis-server on port {self.port}")
        except RolloutSyncError:
            self.stop()
            raise

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_process(process, self.timeout_s)

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

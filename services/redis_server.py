"""A private ``redis-server`` on loopback: what ``baton serve`` starts when no Redis URL is given, and
what the tests run against. Nothing is saved to disk; the server dies with ``stop``."""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import tempfile
import time

from baton import reaper


def redis_binary() -> str | None:
    return shutil.which("redis-server") or next(
        (p for p in ("/usr/bin/redis-server", "/usr/sbin/redis-server") if shutil.which(p)), None)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int = 0, host: str = "127.0.0.1", password: str | None = None,
                 tls: tuple[str, str, str] | None = None) -> None:
        """tls: (cert, key, ca) PEM files: serve TLS only (clients verify the server by the CA)."""
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.binary = binary
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        self.tls = tls
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="baton-redis-")
        reaper.own_dir(self._dir.name)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}{self.host}:{self.port}/0?ssl_ca_certs={self.tls[2]}"
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", "--appendonly", "no",
                "--dir", self._dir.name, "--daemonize", "no", "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            cert, key, ca = self.tls
            i = args.index("--port")
            args[i + 1] = "0"  # no plaintext port
            args += ["--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with status {self.proc.returncode}: {err.strip()}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on {self.host}:{self.port} within {timeout} s")

    def ping(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as raw:
                s = raw
                if self.tls:
                    ctx = ssl.create_default_context(cafile=self.tls[2])
                    s = ctx.wrap_socket(raw, server_hostname=self.host)
                auth = f"AUTH {self.password}\r\n" if self.password else ""
                s.sendall(f"{auth}PING\r\n".encode())
                return b"PONG" in s.recv(256)
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL, as a crash would (for fault tests); ``start`` brings it back on the same port."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        with contextlib.suppress(OSError):
            self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["RedisServer", "free_port", "redis_binary"]

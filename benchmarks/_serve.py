"""`baton serve` as a subprocess for the benchmark scripts: free ports, wait until it answers, stop it; the same for
llama.cpp's llama-server; the median of a stat over measured rounds."""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from baton.api.client import Client, generate_request  # noqa: E402
from baton.services.redis_server import free_port  # noqa: E402


def _answers(grpc_address: str, http_port: int | None) -> bool:
    try:
        with Client(grpc_address) as c:
            c.complete(generate_request("hi", sampling={"max_tokens": 1}), timeout=5)
        if http_port is not None:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=2) as r:
                return r.status == 200
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


@contextlib.contextmanager
def served(weights: str, http: bool = False, timeout_s: float = 600, extra: tuple[str, ...] = (),
           root: Path = ROOT, log: Path | None = None) -> Iterator[SimpleNamespace]:
    """A `baton serve --weights WEIGHTS [EXTRA...]` on free loopback ports (gRPC, and the HTTP API when `http`),
    once it has answered a one-token request (and /health); terminated on exit. ``root``: the checkout to run
    (another commit's, for a side-by-side run); ``log``: a file for the stack's output (else it is dropped)."""
    port, http_port = free_port(), free_port() if http else None
    out = subprocess.DEVNULL if log is None else open(log, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--weights", weights, "--port", str(port),
                             "--http-port", str(http_port if http else -1), "--metrics-port", "-1", *extra],
                            cwd=root, stdout=out, stderr=subprocess.STDOUT)
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while not _answers(address, http_port):
            if proc.poll() is not None:
                raise SystemExit(f"baton serve exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit(f"baton serve did not answer within {timeout_s:.0f} s")
            time.sleep(1)
        yield SimpleNamespace(grpc_address=address, http_port=http_port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        if log is not None:
            out.close()


def llama_server(binary: str | Path, model: str | Path, slots: int, ctx: int,
                 extra: tuple[str, ...] | list[str] = ()) -> tuple[subprocess.Popen, int]:
    """llama.cpp's llama-server (2 threads, its libraries beside the binary) on a free loopback port, once
    /health answers: (process, port). The caller terminates it."""
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "-np", str(slots), "-c", str(ctx), "-t", "2", "--no-webui", *extra],
                            env=dict(os.environ, LD_LIBRARY_PATH=str(Path(binary).parent)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(120):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc, port
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("llama-server did not come up")


def median(rounds: list[dict] | None, key: str) -> float | None:
    """The median of ``key`` over rounds of baton.bench stats (None where no round has it)."""
    values = [s[key] for s in rounds or () if s.get(key) is not None]
    return statistics.median(values) if values else None

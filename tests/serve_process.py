"""`baton serve` as a subprocess, the way a user starts it, for tests that need a launcher of its own."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from pathlib import Path

# What a Ray Client connection prints when the proxy's per-client server died while starting.
SPECIFIC_SERVER_DIED = ("Starting Ray client server failed", "psutil.ZombieProcess")


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def serve_process(argv: list[str], env: dict, log_path: Path):
    """`baton serve ARGV` as a subprocess, logging to LOG_PATH: (process, gRPC address) once it serves; stopped
    on exit, whichever way."""
    proc = None
    try:
        # Ray Client's proxy forks each client's own server from a busy multi-threaded process, and now and
        # then that child dies before it runs, with an empty log of its own. The client then reads "Starting Ray
        # client server failed", or, when the child exits while the proxy reads its command line, the proxy's
        # own psutil.ZombieProcess. Another try is what a user would do, and these tests are about joining, not
        # about that fork.
        attempts = 3
        for attempt in range(attempts):
            with open(log_path, "w") as log:
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + 600
            while not (m := re.search(r"serving baton\.v1\.Generation on (\S+)", log_path.read_text())):
                if proc.poll() is not None:
                    break
                assert time.monotonic() < deadline, "baton serve did not come up\n" + log_path.read_text()[-5000:]
                time.sleep(0.5)
            if m or attempt == attempts - 1 or not any(sign in log_path.read_text() for sign in SPECIFIC_SERVER_DIED):
                break
        assert m, log_path.read_text()[-5000:]
        yield proc, m.group(1)
    finally:
        if proc is not None:
            stop_process(proc)

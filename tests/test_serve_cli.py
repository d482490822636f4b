"""`baton serve` and `baton generate --server` as a user runs them, in separate processes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # starts a stack on the default model
def test_serve_answers_and_stops_on_sigterm(tmp_path):
    port = _free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "serve", "--port", str(port),
                                 "--kv-cache-memory", "0.25"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "serving baton.v1.Generation" not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.5)
        text = (tmp_path / "serve.log").read_text()
        assert f"127.0.0.1:{port}" in text
        # Two workers of one thread each fit two cores: each gets its own, and the router (with the Ray
        # and Redis processes it started) keeps off the decode worker's.
        placed = re.search(r"each worker on its own cores: prefill-0 on ([\d,]+), decode-0 on ([\d,]+); "
                           r"the router on ([\d,]+)", text)
        if len(os.sched_getaffinity(0)) >= 2:
            assert placed, text
            decode = {int(c) for c in placed.group(2).split(",")}
            router = {int(c) for c in placed.group(3).split(",")}
            assert os.sched_getaffinity(proc.pid) == router and not router & decode
        # No Redis URL given and redis-server installed: a private one on loopback, gone after the stop.
        redis_port = int(re.search(r"prefix-cache index at redis://127\.0\.0\.1:(\d+)", text).group(1))
        socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
        r = subprocess.run([sys.executable, "-m", "baton.cli", "generate", "--server", f"127.0.0.1:{port}",
                            "--chat", "--prompt", "What is the capital of France? Answer in one word.",
                            "--temperature", "0",
                            "--max-tokens", "20", "--json"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert "Paris" in out["text"] and out["finish_reason"] == "stop"

        bad = subprocess.run([sys.executable, "-m", "baton.cli", "generate", "--server", f"127.0.0.1:{port}",
                              "--prompt", "hi", "--temperature", "-1"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "shutting down" in (tmp_path / "serve.log").read_text()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

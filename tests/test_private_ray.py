"""`baton serve` without --address starts a private Ray of its own, whatever other Ray runs on the machine: here
a foreign one started the way a user starts one (`ray start --head`, which also makes itself the machine's
"current" cluster). The stack serves, and the foreign cluster is left as it was."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from baton.api.client import Client, generate_request
from baton.services.redis_server import free_port
from tests.serve_process import serve_process, stop_process

pytestmark = pytest.mark.slow  # starts a foreign Ray and a stack

ENV_DROP = ("RAY_ADDRESS", "BATON_TOKEN", "BATON_REDIS_URL", "BATON_GATEWAY_KEY", "BATON_AUTH_TOKENS",
            "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _gcs_answers(address: str, env: dict) -> bool:
    probe = ("import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
             "print(len(ray.nodes()), sorted({a['namespace'] for a in ray.util.list_named_actors(True)}))")
    out = subprocess.run([sys.executable, "-c", probe, address], env=env, capture_output=True, text=True, timeout=120)
    return out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "1 []"


# Ports `ray start` gives its other servers by default (the dashboard agent's 52365 falls in Linux's ephemeral
# range, so a free port can be it) and the worker port range: the head's --port must be none of them.
RAY_DEFAULT_PORTS = {6379, 8265, 10001, 52365, 52366, *range(10002, 20000)}


def _head_port() -> int:
    while (port := free_port()) in RAY_DEFAULT_PORTS:
        pass
    return port


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def foreign_ray(tmp_path):
    """`ray start --head --block` on free loopback ports, in a folder of its own; killed at the end (never `ray
    stop`, which would stop every Ray of the machine)."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    port = _head_port()
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's socket paths must fit in 107 bytes
    log = open(tmp_path / "ray.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([_ray_cli(), "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1",
                             "--num-cpus=1", "--include-dashboard=false", f"--temp-dir={temp}",
                             "--disable-usage-stats"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while not _listening(port) or not _gcs_answers(address, env):
            assert proc.poll() is None, (tmp_path / "ray.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the foreign Ray did not start\n" + (tmp_path / "ray.log").read_text()
            time.sleep(1)
        yield address, env
    finally:
        stop_process(proc)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def test_serve_without_address_starts_its_own_ray_beside_a_foreign_one(foreign_ray, tmp_path):
    address, env = foreign_ray
    argv = [sys.executable, "-m", "baton.cli", "serve", "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
            "--kv-cache-memory", "0.25"]
    with serve_process(argv, env, tmp_path / "serve.log") as (proc, serving):
        with Client(serving) as c:
            out = c.complete(generate_request("Say hi.", sampling={"max_tokens": 3, "temperature": 0}), timeout=120)
        assert len(out.token_ids) == 3
        text = (tmp_path / "serve.log").read_text()
        assert "Found multiple active Ray instances" not in text and "Connecting to latest cluster" not in text
        # the foreign cluster: still one node, and none of the stack's actors in it
        assert _gcs_answers(address, env)
    assert proc.returncode is not None and _gcs_answers(address, env)  # stopping the stack left it running

"""Closed by default: a `baton serve` with its own local Ray listens on loopback only, every process of it, Ray's
included, and that Ray refuses a driver without the stack's token; the stack serves as before."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from gguf import GGUFReader

from baton.api.client import Client, generate_request
from baton.services.redis_server import free_port
from tests.serve_process import serve_process

DRIVER = ("import ray; ray.init(address={address!r}, log_to_driver=False); "
          "print('JOINED', ray.cluster_resources().get('CPU'))")


def _env(**extra: str) -> dict:
    """This test process's environment without any Ray token or address of its own (an in-process stack of
    the test run sets them), plus EXTRA."""
    drop = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "BATON_")) and k not in drop}
    return {**env, **extra}


def _driver(address: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER.format(address=address)], env=env, capture_output=True,
                          text=True, timeout=180)


def _loopback(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return (a.ipv4_mapped or a).is_loopback if a.version == 6 else a.is_loopback


def _tree_pss(pid: int) -> int:
    total = 0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    return total


@pytest.mark.slow
def test_the_default_stack_listens_on_loopback_only_wants_the_token_and_shares_its_weights(tmp_path,
                                                                                          default_model_path):
    argv = [sys.executable, "-m", "baton.cli", "serve", "--port", str(free_port()), "--metrics-port",
            str(free_port()), "--http-port", str(free_port()), "--verbose"]
    log = tmp_path / "serve.log"
    with serve_process(argv, _env(), log) as (proc, address):
        m = re.search(r"local Ray at (\S+) on loopback, token authentication on \(the token is in (\S+)\)",
                      log.read_text())
        assert m, log.read_text()
        ray_address, token_file = m.groups()

        # Every listening socket of every process of the stack, Ray's daemons and workers included.
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        pids = {p.pid for p in tree}
        names = {p.pid: p.name() for p in tree}
        listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.pid in pids]
        owners = {names[c.pid] for c in listening}
        assert {"gcs_server", "raylet", "redis-server"} <= owners, owners
        assert len(listening) >= 12, listening
        wide = [(names[c.pid], c.laddr) for c in listening if not _loopback(c.laddr.ip)]
        assert not wide, wide
        assert ray_address.startswith("127.0.0.1:")

        # The token: in a file only this user can read, in a folder only this user can enter.
        mode = os.stat(token_file)
        assert stat.S_IMODE(mode.st_mode) == 0o600 and mode.st_uid == os.getuid()
        assert stat.S_IMODE(os.stat(os.path.dirname(token_file)).st_mode) == 0o700
        token = Path(token_file).read_text().strip()
        assert len(token) >= 32

        # A driver without the token (and no ~/.ray/auth_token to fall back on), one with a wrong token, and
        # one with the stack's: only the last joins.
        home = tmp_path / "home"
        home.mkdir()
        # Each one told, as the stack's line says, that this Ray's node address is loopback.
        base = _env(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
        cases = {"none": base,
                 "wrong": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * len(token)},
                 "right": {**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_file}}
        with ThreadPoolExecutor(len(cases)) as pool:
            results = dict(zip(cases, pool.map(lambda env: _driver(ray_address, env), cases.values()),
                               strict=True))
        for case in ("none", "wrong"):
            r = results[case]
            assert r.returncode != 0 and "JOINED" not in r.stdout, (case, r.stdout, r.stderr[-2000:])
            assert "InvalidAuthToken" in r.stderr or "Authentication" in r.stderr, (case, r.stderr[-2000:])
        assert "JOINED" in results["right"].stdout, results["right"].stderr[-3000:]

        # And it serves as before.
        with Client(address) as client:
            done = client.complete(generate_request("Hello", sampling={"max_tokens": 4, "temperature": 0}),
                                   timeout=120)
        assert len(done.token_ids) == 4

        # Memory: both workers map one weight image (one copy of the weights on the node), --verbose printed each
        # one's breakdown and the stack's total, and the whole stack, Ray included, holds under 3 GiB (PSS: a
        # shared page counted once) with its two 1 GiB KV pools, also after serving. The weights are the file's
        # own blocks (--weights auto): within 1.15x of its tensor bytes.
        text = log.read_text()
        file_mib = sum(int(t.n_bytes) for t in GGUFReader(default_model_path).tensors) / 2**20
        for worker in ("prefill-0", "decode-0"):
            m = re.search(rf"memory of {worker}: weights (\d+) MiB shared \(a weight image\); KV pool \d+ of 1024 MiB "
                          rf"resident; runtime \d+ MiB", text)
            assert m and 0.9 * file_mib <= int(m.group(1)) <= 1.15 * file_mib, (file_mib, text)
        m = re.search(r"memory of the stack on this host: (\d+) processes, PSS (\d+) MiB", text)
        assert m and int(m.group(2)) < 3 * 1024, text
        assert re.search(r"started in \d+\.\d s", text)
        images = {}
        for p in tree:
            with contextlib.suppress(psutil.Error):
                for mapping in p.memory_maps():
                    if mapping.path.endswith(".img"):
                        images.setdefault(mapping.path, set()).add(p.pid)
        assert len(images) == 1 and len(next(iter(images.values()))) == 2, images
        assert _tree_pss(proc.pid) < 3 * 2**30
    assert not os.path.exists(token_file)  # gone with the stack


OPEN_CLUSTER = """import sys, ray
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=sys.argv[1])
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_joining_a_cluster_without_ray_authentication_needs_an_explicit_flag(tmp_path):
    """`baton serve --address` on a Ray cluster that runs without token authentication exits 2 and says why and
    what to do; with --allow-unauthenticated-ray it joins that cluster and serves."""
    ray_dir = tempfile.mkdtemp(prefix="baton-open-ray-")  # short: Ray's socket paths live under it
    env = _env(RAY_AUTH_MODE="disabled", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", HOME=str(tmp_path))
    cluster = subprocess.Popen([sys.executable, "-c", OPEN_CLUSTER, ray_dir], env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        gcs = cluster.stdout.readline().strip()
        assert re.fullmatch(r"127\.0\.0\.1:\d+", gcs), gcs
        argv = [sys.executable, "-m", "baton.cli", "serve", "--address", gcs, "--port", str(free_port()),
                "--metrics-port", "-1", "--http-port", "-1"]
        refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert "without Ray's token authentication" in refused.stderr, refused.stderr[-3000:]
        assert "--allow-unauthenticated-ray" in refused.stderr and "RAY_AUTH_MODE=token" in refused.stderr

        with serve_process([*argv, "--allow-unauthenticated-ray"], env, tmp_path / "serve.log") as (_, address):
            with Client(address) as client:
                done = client.complete(generate_request("Hello", sampling={"max_tokens": 3, "temperature": 0}),
                                       timeout=120)
            assert len(done.token_ids) == 3
    finally:
        cluster.stdin.close()
        try:
            cluster.wait(timeout=60)
        except subprocess.TimeoutExpired:
            cluster.kill()
            cluster.wait()
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_joining_says_whether_the_cluster_wants_a_token_or_that_it_could_not_tell():
    from baton.serve import _gcs_wants_token, cluster_auth_refusal

    # Nothing listens there: the GCS cannot be asked, which is neither "open" nor "closed".
    assert _gcs_wants_token(f"127.0.0.1:{free_port()}") is None
    assert cluster_auth_refusal("auto", True) is None
    open_cluster = cluster_auth_refusal("ray://head:10001", False)
    assert "runs without Ray's token authentication" in open_cluster and "--allow-unauthenticated-ray" in open_cluster
    unknown = cluster_auth_refusal("ray://head:10001", None)
    assert unknown.startswith("could not tell whether the Ray cluster at ray://head:10001 requires")
    assert "--allow-unauthenticated-ray" in unknown and "runs without" not in unknown

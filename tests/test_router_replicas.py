"""Router replicas: `baton router --stack-name NAME --address ray://...` (a process of its own, the way a user starts
it) serves the session's stack beside the stack's own router: same workers, same prefix index, same limits. Killed
under load, it loses only its own streams: they fail at once with UNAVAILABLE (none hangs), a retry on the other
router succeeds, the other router's clients never notice, and the workers free what the dead router's requests
held."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import grpc
import pytest

from baton.api.client import Client, generate_request
from tests.serve_process import serve_process
from tests.stack_state import idle, stats

pytestmark = pytest.mark.slow
DEADLINE = 60.0


@pytest.fixture(scope="module")
def replica(stack, ray_client_address, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("replica") / "router.log"
    env = {k: v for k, v in os.environ.items() if k not in ("BATON_TOKEN", "BATON_GATEWAY_KEY", "RAY_ADDRESS")}
    argv = [sys.executable, "-m", "baton.cli", "router", "--stack-name", stack.namespace, "--address",
            ray_client_address, "--port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    with serve_process(argv, env, log_path) as (proc, address):
        yield proc, address, log_path


def _one(client: Client, prompt: str) -> tuple[str, int]:
    n = 0
    try:
        for msg in client.stream(generate_request(prompt, sampling={"max_tokens": 24, "temperature": 0,
                                                                    "ignore_eos": True}), timeout=DEADLINE):
            n += len(msg.token_ids)
        return "OK", n
    except grpc.RpcError as e:
        return e.code().name, n


def test_a_replica_serves_the_stack_as_its_router_does(stack, replica):
    _, address, log_path = replica
    text = log_path.read_text()
    assert f"router for stack '{stack.namespace}': 1 prefill and 1 decode workers" in text
    assert "prefix-cache index " in text and "index none" not in text
    with Client(stack.address) as a, Client(address) as b:
        assert b.list_models(timeout=30) == a.list_models(timeout=30)
        req = generate_request("The capital of France is", sampling={"max_tokens": 8, "temperature": 0})
        assert b.complete(req, timeout=DEADLINE).token_ids == a.complete(req, timeout=DEADLINE).token_ids
        # The stack's limits: the same refusal from either router.
        big = generate_request("Hi", sampling={"max_tokens": stack.config.limits.max_output_tokens + 1})
        codes = []
        for c in (a, b):
            with pytest.raises(grpc.RpcError) as e:
                c.complete(big, timeout=30)
            codes.append((e.value.code(), "max_tokens" in e.value.details()))
        assert codes[0] == codes[1] == (grpc.StatusCode.INVALID_ARGUMENT, True)


def test_killing_a_replica_under_load_loses_only_its_own_streams(stack, replica):
    proc, address, _ = replica
    outcomes: dict[str, list] = {"a": [], "b": [], "retried": []}
    stop = threading.Event()
    lock = threading.Lock()

    def user(which: str, k: int) -> None:
        with Client(stack.address) as a, Client(address) as b:
            i = 0
            while not stop.is_set():
                status, n = _one(a if which == "a" else b, f"{which}{k}: request {i}, count upwards.")
                with lock:
                    outcomes[which].append((status, n))
                if status != "OK" and which == "b":  # the client's retry goes to the live router
                    with lock:
                        outcomes["retried"].append(_one(a, f"{which}{k}: request {i} again."))
                    return
                i += 1

    threads = [threading.Thread(target=user, args=("a", k)) for k in range(2)]
    threads += [threading.Thread(target=user, args=("b", k)) for k in range(3)]
    for t in threads:
        t.start()
    time.sleep(6)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(6)
    stop.set()
    for t in threads:
        t.join(timeout=DEADLINE + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    # The replica's clients: OK before the kill, then UNAVAILABLE at once (never a deadline), then a retry that works.
    b_failed = [s for s, _ in outcomes["b"] if s != "OK"]
    assert b_failed and set(b_failed) == {"UNAVAILABLE"}, outcomes["b"]
    assert outcomes["retried"] and all(o == ("OK", 24) for o in outcomes["retried"]), outcomes["retried"]
    # The other router's clients never noticed.
    assert outcomes["a"] and all(o == ("OK", 24) for o in outcomes["a"]), outcomes["a"]
    # The dead router's requests are gone from the workers: no block, no export, no stream left.
    assert idle(stack, timeout=60), stats(stack)


def test_names_and_addresses_are_checked(stack, capsys, monkeypatch):
    """A stack name already taken on the Ray, a replica for a stack that does not run there, one without an
    address or a name, a malformed name: each a one-line error naming what to fix (exit status 2)."""
    from baton.cli import main
    from baton.config import ConfigError, ServeConfig
    from baton.serve import Stack
    from tests.stack_config import STACK_ENGINE

    with pytest.raises(ConfigError, match="already runs on this Ray"):
        Stack(ServeConfig(engine=STACK_ENGINE, port=0, metrics_port=None, http_port=None,
                          stack_name=stack.namespace)).start()
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cases = [(["router", "--stack-name", "no-such-stack", "--address", "auto"], "no stack named 'no-such-stack'"),
             (["router", "--stack-name", stack.namespace], "give its Ray's --address"),
             (["router", "--address", "auto"], "needs --stack-name"),
             (["serve", "--stack-name", "bad name!"], "--stack-name 'bad name!'")]
    handlers = list(logging.getLogger("baton").handlers)
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert logging.getLogger("baton").handlers == handlers  # a refused command leaves no handler on this stdout
    assert stack.router.workers.count("decode") >= 1  # the stack serves on

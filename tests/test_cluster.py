"""Baton on a Ray cluster of several nodes on this machine (tests/cluster_scenarios.py, in a process of
its own so that its Ray is the only one there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cluster") / "seen.json"
    proc = subprocess.run([sys.executable, "-m", "tests.cluster_scenarios", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())


def test_pools_are_placed_on_their_nodes_and_the_handoff_crosses_nodes(seen):
    p = seen["placement"]
    assert p["nodes"]["prefill-0"] == p["expected"]["prefill"]
    assert p["nodes"]["decode-0"] == p["expected"]["decode"]
    assert p["handoffs"] == 3 and p["kv_bytes_received"] > 0  # pulled from the other node's object store
    assert p["outputs"] == p["local"]  # token for token as one process


def test_decode_pool_grows_under_load_and_shrinks_after_without_failures(seen):
    a = seen["autoscale"]
    assert a["outcomes"] and set(a["outcomes"]) == {"OK"}, a["outcomes"]  # no "TIMEOUT": every phase ended
    actions = [(e[1], e[2]) for e in a["events"]]
    assert ("decode", "added") in actions and ("decode", "removed") in actions and a["removed"]
    assert actions.index(("decode", "added")) < actions.index(("decode", "removed"))
    # One client left the pool at 1; eight grew it to its maximum of 2, and the new worker took requests.
    assert a["sizes"] == {"start": 1, "one_client": 1, "grown": 2, "final": 1}, a["sizes"]
    assert a["new_worker_handoffs"] >= 3


def test_losing_a_node_fails_only_in_flight_requests_and_the_pool_refills(seen):
    n = seen["node_loss"]
    assert n["on_spare"], "no decode worker was placed on the node that was removed"
    assert n["in_flight_on_spare"] > 0, "the node was removed with no request in flight on it"
    assert n["during"] and set(n["during"]) <= {"OK", "UNAVAILABLE"}, n["during"]  # no "TIMEOUT"
    # Only requests in flight when the node went can fail (later ones are retried on the other worker): at
    # most one per client (4); the load went on for 8 requests after the loss.
    assert n["during"].count("UNAVAILABLE") <= 4 and len(n["during"]) >= 8, n["during"]
    assert n["after"] == ["OK"] * 4
    assert any(e[2] == "dropped" for e in n["events"]) and any(e[2] == "added" for e in n["events"])
    assert n["refilled"] == 2 and n["refilled_serves"] == ["OK"] * 4

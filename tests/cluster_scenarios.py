"""Cluster scenarios on one machine: a Ray cluster of several nodes (ray.cluster_utils.Cluster, each node
its own raylet and object store, with its own resources), a real stack on it, the default model.

Run as a script so that the cluster's Ray is the only one in its process:

    python -m tests.cluster_scenarios OUT.json

It writes what it saw (placements, outputs, request outcomes, autoscaler events) for
tests/test_cluster.py to check.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time

import grpc
import psutil
import ray
from ray.cluster_utils import Cluster

from baton.api import SamplingParams
from baton.api.client import Client, generate_request
from baton.config import EngineConfig, PoolConfig, ServeConfig
from baton.engine.engine import LLMEngine
from baton.serve import Stack

ENGINE = EngineConfig(dtype="float32", weights="dtype", kv_cache_memory=128 << 20)
PROMPTS = ["The capital of France is", "List three colors:", "Once upon a time"]
STORE = 150 << 20
# The prefix index: the in-memory one (a Ray actor on the head node), not Redis. No scenario here claims
# anything of the index: each runs one prefill worker, so prefix routing never has a choice to make, and
# what they check is placement, the KV hand-off across nodes, scaling and node loss. The Redis index is
# tested against a real redis-server in tests/test_prefix.py and tests/test_prefix_index.py.
INDEX = "memory"


def add_node(cluster: Cluster, **kwargs):
    """cluster.add_node, started again when the new raylet does not register with the GCS within the 30 s that
    Ray's Node waits (a fixed bound; on a loaded 2-core machine a start can take longer): the half-started node's
    processes (this process's children that the failed start left) are ended first, so no second node joins."""
    me = psutil.Process()
    for attempt in range(3):
        before = {p.pid for p in me.children()}
        try:
            return cluster.add_node(**kwargs)
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == 2:
                raise
            left = [p for p in me.children() if p.pid not in before]
            for p in left:
                for q in [*p.children(recursive=True), p]:
                    with contextlib.suppress(psutil.Error):
                        q.kill()
            psutil.wait_procs(left, timeout=30)
            logging.warning("a node did not register within Ray's start-up bound; started it again (%s)", e)
    raise AssertionError("unreachable")


def generate(client: Client, prompt: str, max_tokens: int, timeout: float = 120) -> tuple[str, list[int]]:
    ids: list[int] = []
    try:
        for msg in client.stream(generate_request(prompt, sampling={
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}), timeout=timeout):
            ids += msg.token_ids
    except grpc.RpcError as e:
        return e.code().name, ids
    return "OK", ids


def load(client: Client, clients: int, max_tokens: int, tag: str, done, timeout: float = 300) -> list[str]:
    """``clients`` closed-loop clients until ``done(outcomes)`` holds (checked before each request) or, as a
    last resort against a hang, ``timeout`` seconds pass (then "TIMEOUT" is the last outcome). Returns every
    request's outcome."""
    outcomes: list[str] = []
    deadline = time.monotonic() + timeout

    def user(k: int) -> None:
        i = 0
        while not done(outcomes) and time.monotonic() < deadline:
            status, ids = generate(client, f"[{tag} {k}.{i}] Tell me about the number {i}.", max_tokens)
            outcomes.append(status if status != "OK" or len(ids) == max_tokens else f"SHORT {len(ids)}")
            i += 1

    threads = [threading.Thread(target=user, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not done(outcomes):
        outcomes.append("TIMEOUT")
    return outcomes


def served(n: int):
    """A ``done`` for load(): ``n`` requests have finished."""
    return lambda outcomes: len(outcomes) >= n


def wait_until(cond, timeout: float = 300) -> bool:
    """Poll ``cond()``; the deadline (generous: a cluster of several nodes on a 2-core machine) only ends a
    hang. Returns whether it held."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def placement(cluster: Cluster, nodes: dict) -> dict:
    """Pools placed by resources on their own nodes; the KV hand-off crosses nodes; output as one process."""
    cfg = ServeConfig(engine=ENGINE, port=0, redis_url=INDEX, address=cluster.address,
                      prefill_pool=PoolConfig(resources={"prefill_node": 1}),
                      decode_pool=PoolConfig(resources={"decode_node": 1}), metrics_port=None, http_port=None)
    stack = Stack(cfg).start()
    try:
        infos = ray.get([a.info.remote() for a in stack.prefill + stack.decode])
        with Client(stack.address) as client:
            outputs = [generate(client, p, 12)[1] for p in PROMPTS]
        handoff = ray.get(stack.decode[0].stats.remote())
    finally:
        stack.stop()
    engine = LLMEngine(ENGINE)
    local = [o.token_ids for o in engine.generate([engine.encode_prompt(p) for p in PROMPTS],
                                                  SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
    return {"nodes": {i.name: i.node_id for i in infos}, "expected": nodes, "outputs": outputs,
            "local": local, "kv_bytes_received": handoff["kv_bytes_received"], "handoffs": handoff["handoffs"]}


def autoscale(cluster: Cluster) -> dict:
    """A load ramp grows the decode pool from 1 and the new worker takes requests; the pool shrinks back
    after the load. Phases end on what the stack reports (autoscaler events, worker stats), not on the clock."""
    pool = PoolConfig(max=2, resources={"decode_node": 1}, scale_up_load=3, scale_up_after_s=1,
                      scale_down_after_s=4)
    cfg = ServeConfig(engine=ENGINE, port=0, redis_url=INDEX, address=cluster.address,
                      prefill_pool=PoolConfig(resources={"prefill_node": 1}), decode_pool=pool, metrics_port=None,
                      http_port=None)
    stack = Stack(cfg).start()
    sizes = {"start": len(stack.decode)}

    def added() -> list[str]:
        return [e[3] for e in stack.autoscaler.events if e[1:3] == ("decode", "added")]

    def new_worker_handoffs() -> int:
        handles = [h for h in list(stack.decode) if stack.names.get(h) in added()]
        return sum(s["handoffs"] for s in ray.get([h.stats.remote() for h in handles]))

    handoffs = 0  # the new worker's hand-offs when the pool had grown
    try:
        with Client(stack.address) as client:
            # One client (load 1, under scale_up_load 3): no growth.
            outcomes = load(client, 1, 24, "ramp1", served(6))
            sizes["one_client"] = len(stack.decode)
            # Eight clients until the pool has grown and the router has sent the new worker requests. The size
            # is read when that holds: while the clients finish their last requests the new worker may sit idle
            # for scale_down_after_s and be drained, which is the shrink this scenario checks next.
            def grown(_) -> bool:
                nonlocal handoffs
                if "grown" not in sizes and added() and (n := new_worker_handoffs()) >= 3:
                    sizes["grown"], handoffs = len(stack.decode), n
                return "grown" in sizes

            outcomes += load(client, 8, 24, "ramp8", grown)
            outcomes += load(client, 1, 8, "after", served(2))
            # Idle: the newest worker is drained and removed after scale_down_after_s.
            removed = wait_until(lambda: len(stack.decode) == 1
                                 and any(e[1:3] == ("decode", "removed") for e in stack.autoscaler.events))
            outcomes += load(client, 2, 8, "shrunk", served(4))  # still serving after the shrink
    finally:
        events = [list(e) for e in stack.autoscaler.events]
        sizes["final"] = len(stack.decode)
        stack.stop()
    return {"outcomes": outcomes, "sizes": sizes, "events": events, "new_worker_handoffs": handoffs,
            "removed": removed}


def node_loss(cluster: Cluster) -> dict:
    """A node with a decode worker goes away under load: in-flight requests end UNAVAILABLE or are retried,
    later ones succeed; when a new node joins (as Ray's autoscaler would add one) the pool refills there."""
    # Each decode worker needs 2 units: one fits on the decode node (3) and one on the spare (2).
    spare = add_node(cluster, num_cpus=1, resources={"decode_node": 2}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    cfg = ServeConfig(engine=ENGINE, port=0, redis_url=INDEX, address=cluster.address, decode=2,
                      prefill_pool=PoolConfig(resources={"prefill_node": 1}),
                      decode_pool=PoolConfig(max=2, resources={"decode_node": 2}, scale_up_load=1000),
                      metrics_port=None, http_port=None)
    stack = Stack(cfg).start()
    try:
        infos = ray.get([a.info.remote() for a in stack.decode])
        on_spare = [i.name for i in infos if i.node_id == spare.node_id]
        spare_worker = next(h for h, i in zip(stack.decode, infos, strict=True) if i.node_id == spare.node_id)
        results: dict = {}
        removal: dict = {}
        lock = threading.Lock()
        with Client(stack.address) as client:
            def remove_under_load(outcomes: list[str]) -> bool:
                """load()'s ``done`` (its clients call it before each request): remove the spare node once its
                worker streams requests (checked, not assumed after a wait); then go on until 8 more requests
                have finished."""
                with lock:
                    if not removal:
                        streams = ray.get(spare_worker.stats.remote())["active_streams"]
                        if streams == 0:
                            return False
                        removal.update(streams=streams, served=len(outcomes))
                        cluster.remove_node(spare, allow_graceful=False)
                    return len(outcomes) >= removal["served"] + 8

            results["during"] = load(client, 4, 48, "loss", remove_under_load)
            results["in_flight_on_spare"] = removal.get("streams", 0)
            results["after"] = [generate(client, f"after loss {i}", 8)[0] for i in range(4)]
            add_node(cluster, num_cpus=1, resources={"decode_node": 2}, object_store_memory=STORE)
            # Until the replacement serves (the autoscaler says "added" once it does).
            wait_until(lambda: any(e[2] == "added" for e in stack.autoscaler.events))
            refilled = len(stack.decode)
            results["refilled_serves"] = [generate(client, f"refilled {i}", 8)[0] for i in range(4)]
        events = [list(e) for e in stack.autoscaler.events]
    finally:
        stack.stop()
    return {"on_spare": on_spare, "events": events, "refilled": refilled, **results}


def main(out: str) -> int:
    logging.basicConfig(level=logging.WARNING)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": STORE,
                                                              "include_dashboard": False})
    prefill_node = add_node(cluster, num_cpus=1, resources={"prefill_node": 2}, object_store_memory=STORE)
    decode_node = add_node(cluster, num_cpus=1, resources={"decode_node": 3}, object_store_memory=STORE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    result: dict = {}
    try:
        nodes = {"prefill": prefill_node.node_id, "decode": decode_node.node_id, "head": cluster.head_node.node_id}
        t = time.monotonic()
        result["placement"] = placement(cluster, nodes)
        result["autoscale"] = autoscale(cluster)
        result["node_loss"] = node_loss(cluster)
        result["seconds"] = time.monotonic() - t
    finally:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""The flags and environment variables README.md documents that no other test reached, through the real CLI:
``baton.cli.build_parser()`` and ``serve_config`` for where each lands in the config, and behaviour where it
has one and a check is cheap:

- a `baton serve` of its own (a subprocess) that joins the session's Ray through RAY_ADDRESS (``ray://``, by a
  Ray Client server, as ``--address ray://HEAD:10001`` on a cluster), with its tokens
  from BATON_AUTH_TOKENS, TLS flags, one sequence per batch (``--max-batch 1``, which lets PRIORITY_BATCH
  show), no prefix cache, no chunked prefill and a 1 MiB message limit; `baton generate --server` and
  `baton bench` reach it with ``--tls-ca``, ``--token`` and BATON_TOKEN;
- `baton bench` against the session's stack: ``--plots``, ``--duration``, ``--slo-*``, ``--label``;
- `baton bench` against an OpenAI-compatible server that sends no usage chunk, and against llama.cpp's server
  (a recording of its stream, replayed), with and without its usage chunk;
- the scaling flags, through a `baton serve` of its own: a decode worker added under load and removed when idle;
- pool labels and resources as Ray places actors by them.

(Already covered elsewhere: tests/test_config.py maps --kv-cache-memory, --admission-wait-ms, --max-message-mib,
--metrics-port, --no-prefix-cache, --max-batch, --prefill-max, --scale-up-load and --prefill-resources;
tests/test_cli.py the generate errors; tests/test_security.py tokens files, TLS and the gateway's TLS flags.)
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import ray

from baton import flags
from baton.api import SamplingParams
from baton.api.client import Client, generate_request
from baton.bench.runner import poisson_times
from baton.cli import _sampling, build_parser, main, serve_config
from baton.config import GIB, MIB, ConfigError, EngineConfig, Limits, PoolConfig, PrefixRoutingConfig, ServeConfig
from baton.security import ALL, TLSConfig, Tokens, gateway_key
from baton.v1 import generation_pb2 as pb
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc
from tests.certs import make_certs
from tests.serve_process import serve_process

TOKEN = "documented-token-0123456789"
BATCH_TOKEN = "documented-batch-token-0123456789"
PNG = b"\x89PNG\r\n\x1a\n"


def _serve(*argv: str):
    return serve_config(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


# ---- `baton serve`: flag -> config --------------------------------------------------------------------------

SERVE_FLAGS = {
    "prefill-decode": (["--prefill", "2", "--decode", "3"], lambda c: (c.prefill, c.decode) == (2, 3)),
    "host-port": (["--host", "0.0.0.0", "--port", "6000"], lambda c: (c.host, c.port) == ("0.0.0.0", 6000)),
    "address-ray-client": (["--address", "ray://HEAD:10001"], lambda c: c.address == "ray://HEAD:10001"),
    "address-auto": (["--address", "auto"], lambda c: c.address == "auto"),
    "model-flags": (["--model", "/m/model.gguf", "--dtype", "bfloat16", "--device", "cpu", "--kv-dtype", "int8",
                     "--weights", "q4"],
                    lambda c: (c.engine.model, c.engine.dtype, c.engine.device, c.engine.kv_dtype, c.engine.weights)
                    == ("/m/model.gguf", "bfloat16", "cpu", "int8", "q4")),
    "prefill-passes": (["--max-batched-tokens", "512", "--prefill-chunk", "64", "--prefill-order", "arrival"],
                       lambda c: (c.engine.max_num_batched_tokens, c.engine.prefill_chunk, c.engine.prefill_order)
                       == (512, 64, "arrival") and c.engine.enable_chunked_prefill),
    "no-chunked-prefill": (["--no-chunked-prefill"],
                           lambda c: not c.engine.enable_chunked_prefill and c.engine.enable_prefix_caching),
    "threads-per-worker": (["--threads-per-worker", "3"], lambda c: c.threads_per_worker == 3),
    # The launcher pins itself too unless told not to: --no-pin-cpus turns both off.
    "pin-default": ([], lambda c: c.pin_cpus and c.pin_router),
    "no-pin-cpus": (["--no-pin-cpus"], lambda c: not c.pin_cpus and not c.pin_router),
    "limits": (["--max-in-flight", "9", "--max-prompt-tokens", "100", "--max-output-tokens", "50",
                "--max-streams-per-client", "3", "--max-streams-per-decode-worker", "4", "--max-queue-seconds", "0.5"],
               lambda c: c.limits == Limits(max_in_flight=9, max_prompt_tokens=100, max_output_tokens=50,
                                            max_streams_per_client=3, max_streams_per_decode_worker=4,
                                            max_queue_s=0.5)),
    "prefix-routing": (["--redis-url", "redis://:pw@10.0.0.5:6379/0", "--prefix-load-weight", "0.5",
                        "--prefix-max-queue", "3", "--index-ttl", "7.5"],
                       lambda c: (c.redis_url, c.prefix_routing, c.index_ttl_s)
                       == ("redis://:pw@10.0.0.5:6379/0", PrefixRoutingConfig(load_weight=0.5, max_queue=3), 7.5)),
    "observability-free-ports": (["--otlp-endpoint", "http://127.0.0.1:4317", "--metrics-port", "0", "--http-port",
                                  "0"], lambda c: (c.otlp_endpoint, c.metrics_port, c.http_port)
                                 == ("http://127.0.0.1:4317", 0, 0)),
    "http-off": (["--http-port", "-1", "--metrics-port", "9500"],
                 lambda c: c.http_port is None and c.metrics_port == 9500),
    "pools": (["--decode-max", "4", "--decode-resources", '{"decode_node": 2}', "--prefill-labels",
               "zone=a,tier=compute", "--decode-labels", "tier=memory", "--scale-up-after", "5", "--scale-down-after",
               "60"],
              lambda c: c.prefill_pool == PoolConfig(labels={"zone": "a", "tier": "compute"}, scale_up_after_s=5.0,
                                                     scale_down_after_s=60.0)
              and c.decode_pool == PoolConfig(max=4, resources={"decode_node": 2.0}, labels={"tier": "memory"},
                                              scale_up_after_s=5.0, scale_down_after_s=60.0)),
    "allow-unauthenticated-ray": (["--allow-unauthenticated-ray"],
                                  lambda c: c.allow_unauthenticated_ray
                                  and not ServeConfig().allow_unauthenticated_ray),
    "stack-name": (["--stack-name", "prod-1"], lambda c: c.stack_name == "prod-1" and ServeConfig().stack_name is None),
    "migrations": (["--max-migrations", "0", "--replacement-wait-seconds", "5", "--stall-seconds", "9"],
                   lambda c: (c.limits.max_migrations, c.limits.replacement_wait_s, c.limits.stall_s) == (0, 5.0, 9.0)
                   and (Limits().max_migrations, Limits().replacement_wait_s, Limits().stall_s) == (3, 120.0, 60.0)),
    "auth-tokens-file": (["--auth-tokens-file", "/etc/baton/tokens"],
                         lambda c: c.auth_tokens_file == "/etc/baton/tokens"),
}


@pytest.mark.parametrize("name", SERVE_FLAGS)
def test_serve_flag_reaches_the_config(name):
    argv, check = SERVE_FLAGS[name]
    assert check(_serve(*argv)), argv


def _passes(default_model, flags: list[str], prompts: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """An engine built from `baton serve` flags runs prompts of the given lengths (one output token each):
    each pass's (sequences, tokens), and the order in which the prompts finished."""
    from baton.engine.engine import LLMEngine

    engine = LLMEngine(_serve(*flags).engine, loaded=default_model)
    ids = {engine.add_request([5 + (i % 50) for i in range(n)], SamplingParams(max_tokens=1)): k
           for k, n in enumerate(prompts)}
    passes, order = [], []
    while engine.has_unfinished():
        order += [ids[o.request_id] for o in engine.step() if o.finished]
        passes.append(engine.last_batch)
    return passes, order


def test_prefill_chunk_and_max_batched_tokens_shape_the_passes(default_model):
    flags = ["--prefill-chunk", "16", "--max-batched-tokens", "24"]
    one, _ = _passes(default_model, flags, [60])
    assert [t for _, t in one] == [16, 16, 16, 12]  # one prompt: its chunk a pass, not the budget's 24
    chunked, _ = _passes(default_model, flags, [60, 60])
    tokens = [t for _, t in chunked]
    assert max(tokens) == 24 and sum(tokens) == 120  # at most the budget a pass, every prompt token once
    whole, _ = _passes(default_model, [], [60, 60])
    assert max(t for _, t in whole) > 24 and len(whole) < len(chunked)  # without the flags: larger passes


def test_prefill_order_flag(default_model):
    """A long prompt arrives first, then a short one, and a pass holds 32 tokens: in arrival order the short
    one waits for the long one's chunks; `shortest` finishes it first."""
    flags = ["--prefill-chunk", "32", "--max-batched-tokens", "32"]
    _, arrival = _passes(default_model, [*flags, "--prefill-order", "arrival"], [200, 10])
    _, shortest = _passes(default_model, [*flags, "--prefill-order", "shortest"], [200, 10])
    assert arrival == [0, 1] and shortest == [1, 0]


def test_index_ttl_flag_is_the_lifetime_of_index_entries():
    """Entries a worker publishes under `--index-ttl 2` expire in Redis within two seconds unless refreshed."""
    from baton.services.prefix_index import IndexSpec
    from baton.services.redis_server import RedisServer

    ttl = _serve("--index-ttl", "2").index_ttl_s
    with RedisServer() as redis_server:
        index = IndexSpec(redis_server.url, "documented", ttl).connect()
        index.update("w", {b"\x01" * 16: 1.0}, [])
        assert 0 < index.client.ttl(index.key(b"\x01" * 16)) <= 2


def test_pool_labels_and_resources_become_ray_placement():
    """--prefill-labels / --decode-labels / --*-resources as the actor options the workers are created with."""
    c = _serve("--prefill-labels", "zone=a", "--prefill-resources", "prefill_node=1,fast=0.5",
               "--decode-labels", '{"tier": "memory"}')
    assert c.prefill_pool.actor_options("cpu") == {"resources": {"prefill_node": 1.0, "fast": 0.5},
                                                   "label_selector": {"zone": "a"}}
    assert c.decode_pool.actor_options("cpu") == {"label_selector": {"tier": "memory"}}
    assert c.decode_pool.actor_options("cuda") == {"label_selector": {"tier": "memory"}, "num_gpus": 1}
    with pytest.raises(ConfigError, match="--prefill-"):
        _serve("--prefill-labels", "no-equals-sign")


@pytest.mark.slow
def test_ray_places_actors_by_the_pools_labels_and_resources(stack):
    """The options --*-labels / --*-resources make are ones Ray honours: a label this node carries places the
    actor here; a label or a resource no node has leaves it waiting for such a node."""
    import ray._private.state as ray_state

    node = ray.get_runtime_context().get_node_id()
    here = _serve("--prefill-labels", f"ray.io/node-id={node}", "--decode-labels", "tier=documented-nowhere")
    elsewhere = _serve("--prefill-resources", "documented_node=1")

    class Probe:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

    make = lambda pool: ray.remote(Probe).options(num_cpus=0, **pool.actor_options("cpu")).remote()
    actors = [make(elsewhere.prefill_pool), make(here.decode_pool), make(here.prefill_pool)]
    try:
        assert ray.get(actors[2].node.remote(), timeout=120) == node
        states = [ray_state.actors(a._actor_id.hex())["State"] for a in actors[:2]]
        assert states == ["PENDING_CREATION", "PENDING_CREATION"]
    finally:
        for a in actors:
            ray.kill(a)


def test_tls_flags_make_the_tls_config(certs):
    c = _serve("--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"],
               "--tls-server-name", "localhost")
    assert c.tls == TLSConfig(certs["cert"], certs["key"], certs["ca"], "localhost")
    assert _serve("--tls-cert", certs["cert"], "--tls-key", certs["key"]).tls == TLSConfig(certs["cert"], certs["key"])
    assert _serve().tls is None
    for argv, message in ((["--tls-cert", certs["cert"]], "go together"), (["--tls-ca", certs["ca"]], "--tls-ca needs"),
                          (["--tls-cert", certs["cert"], "--tls-key", "/nonexistent/key.pem"], "/nonexistent/key.pem")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            _serve(*argv)


def test_gateway_host_flag():
    args = build_parser().parse_args(["gateway", "--router", "10.0.0.1:50051", "--host", "0.0.0.0", "--http-port",
                                      "8080"])
    assert args.router == "10.0.0.1:50051"
    assert flags.from_flags(ServeConfig, args) == {"host": "0.0.0.0", "http_port": 8080}


# ---- environment variables read before anything starts --------------------------------------------------------


def test_auth_tokens_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BATON_AUTH_TOKENS", f" {TOKEN} ,{BATCH_TOKEN},")
    tokens = Tokens.load()
    assert tokens.check(TOKEN) == ALL and tokens.check(BATCH_TOKEN) == ALL and tokens.check("x" * 20) is None
    f = tmp_path / "tokens"
    f.write_text("file-token-0123456789abcdef Tokenize\n")
    both = Tokens.load(str(f))  # the file and the environment together
    assert both.check("file-token-0123456789abcdef") == {"Tokenize"} and both.check(TOKEN) == ALL
    monkeypatch.setenv("BATON_AUTH_TOKENS", "")
    assert Tokens.load() is None


def test_gateway_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("BATON_GATEWAY_KEY", "documented-gateway-key-0123")
    assert gateway_key() == "documented-gateway-key-0123"
    monkeypatch.delenv("BATON_GATEWAY_KEY")
    assert gateway_key() != gateway_key()  # made per stack when not given


@pytest.mark.parametrize("name,value,message", [
    ("BATON_AUTH_TOKENS", "too-short", "BATON_AUTH_TOKENS: tokens must be at least 16 characters"),
    ("BATON_GATEWAY_KEY", "short", "BATON_GATEWAY_KEY must be at least 16 characters"),
    ("BATON_REDIS_URL", "localhost:6379", "BATON_REDIS_URL 'localhost:6379' must start with redis://"),
])
def test_serve_reads_the_environment_before_it_starts(name, value, message):
    """`baton serve` reads these before it starts anything: a bad value is a one-line error, exit status 2."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("BATON_AUTH_TOKENS", "BATON_GATEWAY_KEY", "BATON_REDIS_URL", "RAY_ADDRESS")}
    r = subprocess.run([sys.executable, "-m", "baton.cli", "serve", "--port", "0", "--metrics-port", "-1"],
                       env={**env, name: value}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_standalone_gateway_checks_its_key_before_it_starts():
    env = {k: v for k, v in os.environ.items() if k != "BATON_GATEWAY_KEY"}
    r = subprocess.run([sys.executable, "-m", "baton.cli", "gateway", "--router", "127.0.0.1:1", "--http-port", "0"],
                       env={**env, "BATON_GATEWAY_KEY": "short"}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "BATON_GATEWAY_KEY must be at least 16 characters" in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- `baton generate`: flag -> request and engine ------------------------------------------------------------


def test_generate_flags_reach_the_request_and_the_engine():
    args = build_parser().parse_args([
        "generate", "--prompt", "hi", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "5",
        "--min-p", "0.1", "--seed", "11", "--stop", "END", "--stop", "\n\n", "--repetition-penalty", "1.2",
        "--presence-penalty", "0.3", "--frequency-penalty", "-0.4", "--model", "/m/model.gguf", "--dtype", "float16",
        "--device", "cpu", "--kv-cache-memory", "0.5", "--kv-dtype", "int8", "--weights", "int8"])
    assert _sampling(args) == SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=11,
                                             stop=("END", "\n\n"), repetition_penalty=1.2, presence_penalty=0.3,
                                             frequency_penalty=-0.4)
    assert EngineConfig(**flags.from_flags(EngineConfig, args)) == EngineConfig(
        model="/m/model.gguf", dtype="float16", device="cpu", kv_cache_memory=GIB // 2, kv_dtype="int8",
        weights="int8")
    with pytest.raises(SystemExit):  # the batching flags are serve's
        build_parser().parse_args(["generate", "--prompt", "hi", "--max-batch", "4"])


def _generate(capsys, *argv: str) -> tuple[int, dict | None, str]:
    rc = main(["generate", *argv, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


@pytest.mark.slow
def test_generate_sampling_flags_over_grpc(stack, capsys):
    """--stop, --seed, --top-k and --min-p as the server applies them (the session's stack)."""
    base = ["--server", stack.address, "--chat", "--prompt", "Name five colors, separated by commas.",
            "--max-tokens", "16"]
    rc, greedy, err = _generate(capsys, *base, "--temperature", "0")
    assert rc == 0, err
    words = re.findall(r"[A-Za-z]{3,}", greedy["text"])
    assert len(words) >= 2, greedy
    stop = words[1]
    rc, stopped, err = _generate(capsys, *base, "--temperature", "0", "--stop", stop)
    assert rc == 0, err
    assert stopped["finish_reason"] == "stop" and stopped["text"] == greedy["text"][:greedy["text"].index(stop)]
    # At temperature 1, keeping only the most likely token (top-k 1, or min-p 1) is greedy decoding.
    for extra in (["--top-k", "1", "--seed", "3"], ["--min-p", "1.0", "--seed", "4"]):
        rc, out, err = _generate(capsys, *base, "--temperature", "1", *extra)
        assert rc == 0, err
        assert out["token_ids"] == greedy["token_ids"], extra
    seeded = [_generate(capsys, *base, "--temperature", "1", "--seed", "7") for _ in range(2)]
    assert seeded[0][0] == seeded[1][0] == 0 and seeded[0][1]["token_ids"] == seeded[1][1]["token_ids"]


# ---- where Baton's servers listen ------------------------------------------------------------------------------


@pytest.mark.slow
def test_batons_servers_listen_on_loopback_only(stack):
    """README: Baton's own servers listen on loopback unless --host says so. Every port the stack names (router,
    workers, HTTP API) is listening, and only on a loopback address, as the kernel's socket table says. (Every
    socket of a `baton serve`'s process tree, Ray's included: tests/test_lockdown.py.)"""
    import ipaddress

    import psutil

    infos = ray.get([w.info.remote() for w in [*stack.prefill, *stack.decode]], timeout=60)
    addresses = [stack.address, stack.gateway.address, *(i.address for i in infos),
                 *stack.metrics_addresses.values()]
    ports = {int(a.rsplit(":", 1)[1]) for a in addresses}
    assert len(ports) == len(addresses) >= 4
    listening = [c for c in psutil.net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port in ports]
    assert {c.laddr.port for c in listening} == ports
    for c in listening:  # 127.0.0.1, ::1, or 127.0.0.1 mapped into an IPv6 socket (as gRPC binds it)
        ip = ipaddress.ip_address(c.laddr.ip)
        assert (ip.ipv4_mapped or ip).is_loopback if ip.version == 6 else ip.is_loopback, c


# ---- PRIORITY_BATCH -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_batch_request_is_served_like_an_interactive_one(stack):
    """`priority: PRIORITY_BATCH` changes when a request runs, not what it gets."""
    with Client(stack.address) as client:
        outs = [client.complete(generate_request(messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                                 sampling={"max_tokens": 8, "temperature": 0}, priority=p),
                                timeout=120)
                for p in (pb.PRIORITY_BATCH, pb.PRIORITY_INTERACTIVE)]
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) >= 1
    assert outs[0].finish_reason == outs[1].finish_reason and outs[0].usage.completion_tokens == len(outs[0].token_ids)


# ---- a `baton serve` of its own that joins the session's Ray ---------------------------------------------------


@pytest.fixture(scope="module")
def joined(stack, ray_client_address, certs, tmp_path_factory):
    """`baton serve` (a subprocess) joining the session's cluster through RAY_ADDRESS (ray://, by Ray Client), its
    tokens from BATON_AUTH_TOKENS."""
    before = {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    log_path = tmp_path_factory.mktemp("joined") / "serve.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("BATON_TOKEN", "BATON_REDIS_URL", "BATON_GATEWAY_KEY", "BATON_AUTH_TOKENS")}
    env.update(RAY_ADDRESS=ray_client_address, BATON_AUTH_TOKENS=f"{TOKEN},{BATCH_TOKEN}")
    argv = [sys.executable, "-m", "baton.cli", "serve", "--port", "0", "--http-port", "-1", "--metrics-port", "-1",
            "--kv-cache-memory", "0.25", "--max-batch", "1", "--no-prefix-cache", "--no-chunked-prefill",
            "--threads-per-worker", "2", "--admission-wait-ms", "5", "--max-message-mib", "1", "--no-pin-cpus",
            "--tls-cert", certs["cert"], "--tls-key", certs["key"], "--tls-ca", certs["ca"]]
    with serve_process(argv, env, log_path) as (proc, address):
        namespaces = {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)} - before
        yield SimpleNamespace(address=address, proc=proc, log=log_path, namespaces=namespaces, certs=certs)


def _workers(joined) -> dict:
    (ns,) = joined.namespaces
    return {name: ray.get_actor(name, namespace=ns) for name in ("prefill-0", "decode-0")}


@pytest.mark.slow
def test_ray_address_joins_the_running_cluster(joined, stack):
    """RAY_ADDRESS=ray://HOST:PORT: the stack's workers are actors of the session's cluster (no Ray of its own, so
    no pinning); the cluster's own stack keeps serving."""
    assert len(joined.namespaces) == 1, joined.namespaces
    infos = ray.get([w.info.remote() for w in _workers(joined).values()], timeout=60)
    assert {i.node_id for i in infos} <= {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    text = joined.log.read_text()
    assert "each worker on its own cores" not in text
    assert "prefix-cache index" not in text  # --no-prefix-cache: no index either
    with Client(stack.address) as client:
        assert len(client.complete(generate_request("Hi", sampling={"max_tokens": 2}), timeout=60).token_ids) == 2


@pytest.mark.slow
def test_serve_flags_reach_the_workers(joined):
    """What each worker of the joined stack was started with, read inside the worker."""
    def read(w):
        import torch

        sched = w.engine.scheduler.config
        return (w.spec, w.loop.call(torch.get_num_threads), w.loop.admission_wait, sched.max_num_seqs,
                sched.enable_prefix_caching, sched.enable_chunked_prefill, w.engine.config.kv_cache_memory)

    for name, worker in _workers(joined).items():
        spec, threads, wait, max_seqs, prefix, chunked, kv = ray.get(worker.__ray_call__.remote(read), timeout=60)
        # --threads-per-worker 2: the engine's thread computes with 2; --no-pin-cpus (and a joined cluster): no cores.
        assert spec.threads == threads == 2 and spec.cpus is None, name
        assert wait == pytest.approx(0.005), name  # --admission-wait-ms 5
        assert (max_seqs, prefix, chunked) == (1, False, False), name
        assert kv == GIB // 4, name
        assert spec.tls == TLSConfig(joined.certs["cert"], joined.certs["key"], joined.certs["ca"]), name


@pytest.mark.slow
def test_generate_client_tls_ca_token_and_baton_token(joined, capsys, monkeypatch):
    """`baton generate --server ... --tls-ca PEM --token T`, or the token from BATON_TOKEN; the server's tokens
    come from BATON_AUTH_TOKENS."""
    monkeypatch.delenv("BATON_TOKEN", raising=False)
    base = ["--server", joined.address, "--prompt", "Say hi.", "--max-tokens", "3", "--temperature", "0"]
    ca = ["--tls-ca", joined.certs["ca"]]
    rc, out, err = _generate(capsys, *base, *ca, "--token", TOKEN)
    assert rc == 0, err
    assert 1 <= len(out["token_ids"]) <= 3 and out["text"]
    rc, _, err = _generate(capsys, *base, *ca)
    assert rc == 1 and "UNAUTHENTICATED: missing credentials" in err
    monkeypatch.setenv("BATON_TOKEN", BATCH_TOKEN)  # the server's second token
    rc, from_env, err = _generate(capsys, *base, *ca)
    assert rc == 0, err
    assert from_env["token_ids"] == out["token_ids"]
    rc, _, err = _generate(capsys, *base, *ca, "--token", "not-a-token-0123456789")  # the flag wins
    assert rc == 1 and "UNAUTHENTICATED: the bearer token is not valid" in err
    rc, _, err = _generate(capsys, *base, "--token", TOKEN)  # plaintext to a TLS port
    assert rc == 1 and "UNAVAILABLE" in err
    rc, _, err = _generate(capsys, *base, "--tls-ca", joined.certs["other-ca"], "--token", TOKEN)
    assert rc == 1 and "UNAVAILABLE" in err


@pytest.mark.slow
def test_workers_take_only_the_routers_certificate(joined):
    """--tls-ca: mutual TLS between router and workers; a client without the router's certificate is refused."""
    info = ray.get(_workers(joined)["prefill-0"].info.remote(), timeout=60)
    creds = grpc.ssl_channel_credentials(Path(joined.certs["ca"]).read_bytes())  # TLS, no client certificate
    for channel in (grpc.insecure_channel(info.address), grpc.secure_channel(info.address, creds)):
        with channel, pytest.raises(grpc.RpcError) as e:
            wgrpc.PrefillWorkerStub(channel).Release(wpb.ReleaseRequest(request_id="x"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:No artists with labels:UserWarning")  # the scatter of a run with no answers
def test_bench_client_tls_ca_and_token(joined, tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_TOKEN", raising=False)
    target = ["--target", f"grpc://{joined.address}", "--tls-ca", joined.certs["ca"], "--requests", "2", "--warmup",
              "0", "--prompt-tokens", "16", "--output-tokens", "3"]

    def run(name: str, *extra: str) -> dict:
        assert main(["bench", *target, *extra, "--json", str(tmp_path / f"{name}.json")]) == 0
        return json.loads((tmp_path / f"{name}.json").read_text())["levels"][0]["stats"]

    s = run("flag", "--token", TOKEN)
    assert s["completed"] == 2 and not s["errors"] and s["output_tokens"] == 6
    monkeypatch.setenv("BATON_TOKEN", TOKEN)
    s = run("env")
    assert s["completed"] == 2 and not s["errors"]
    monkeypatch.delenv("BATON_TOKEN")
    s = run("none")
    assert s["completed"] == 0 and s["errors"] == {"UNAUTHENTICATED": 2}


@pytest.mark.slow
def test_no_prefix_cache_computes_every_prompt(joined, stack):
    """--no-prefix-cache: a prompt sent twice is computed twice; the session's stack (cache on) reuses it."""
    prompt = "You are a helpful assistant. " * 12 + "Tell me about rivers."

    def cached(address: str, tls_ca: str | None) -> list[int]:
        with Client(address, tls_ca=tls_ca, token=TOKEN) as client:
            return [client.complete(generate_request(prompt, sampling={"max_tokens": 2}), timeout=120)
                    .usage.cached_prompt_tokens for _ in range(2)]

    assert cached(joined.address, joined.certs["ca"]) == [0, 0]
    assert cached(stack.address, None)[1] > 0


@pytest.mark.slow
def test_long_prompt_without_chunked_prefill(joined):
    """--no-chunked-prefill: a prompt longer than a pass's token budget (256) is still served, in one pass."""
    ids = list(range(1000, 1400))
    with Client(joined.address, tls_ca=joined.certs["ca"], token=TOKEN) as client:
        out = client.complete(generate_request(prompt_token_ids=ids, sampling={"max_tokens": 2}), timeout=300)
    assert out.usage.prompt_tokens == 400 and len(out.token_ids) == 2


@pytest.mark.slow
def test_max_message_mib(joined):
    """--max-message-mib 1: a request message over 1 MiB is refused with RESOURCE_EXHAUSTED before it is read;
    one under it gets as far as the prompt checks."""
    def code(n_ids: int) -> grpc.StatusCode:
        req = generate_request(prompt_token_ids=[1000] * n_ids, sampling={"max_tokens": 1})
        with Client(joined.address, tls_ca=joined.certs["ca"], token=TOKEN) as client, \
                pytest.raises(grpc.RpcError) as e:
            client.complete(req, timeout=120)
        return e.value.code()

    assert 450_000 * 2 < MIB < 600_000 * 2  # two bytes per id
    assert code(600_000) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code(450_000) == grpc.StatusCode.INVALID_ARGUMENT  # longer than the context


@pytest.mark.slow
def test_priority_batch_waits_behind_interactive_requests(joined):
    """With one sequence per decode batch (--max-batch 1), a batch request and then an interactive one queue
    behind a running request: the interactive one goes first (PRIORITY_BATCH is admitted after it)."""
    decode = _workers(joined)["decode-0"]
    events: dict[str, list[int]] = {"b2": [], "i": []}
    finished: list[str] = []
    lock = threading.Lock()

    def decode_requests() -> int:
        return ray.get(decode.stats.remote(), timeout=30)["requests"]

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 120
        while decode_requests() != n:
            assert time.monotonic() < deadline, f"the decode worker never held {n} requests"
            time.sleep(0.05)

    def consume(name: str, call) -> None:
        try:
            for msg in call:
                with lock:
                    events[name].append(len(msg.token_ids))
        except grpc.RpcError as e:
            finished.append(f"{name}: {e.code().name}")
            return
        with lock:
            finished.append(name)

    req = lambda prio, n: generate_request("Count from one to one thousand.", priority=prio,
                                          sampling={"max_tokens": n, "temperature": 0, "ignore_eos": True})
    with Client(joined.address, tls_ca=joined.certs["ca"], token=TOKEN) as client:
        first = client.stream(req(pb.PRIORITY_BATCH, 2000), timeout=300)
        events["b1"] = []
        holder = threading.Thread(target=consume, args=("b1", first), daemon=True)
        holder.start()
        wait_for(1)
        threads = []
        for name, prio, n in (("b2", pb.PRIORITY_BATCH, 48), ("i", pb.PRIORITY_INTERACTIVE, 4)):
            t = threading.Thread(target=consume, args=(name, client.stream(req(prio, n), timeout=300)), daemon=True)
            t.start()
            threads.append(t)
            wait_for(len(threads) + 1)
        with lock:  # one sequence per batch: neither has a decode token yet (the first comes from prefill)
            assert sum(events["b2"]) <= 1 and sum(events["i"]) <= 1, events
        first.cancel()
        for t in threads:
            t.join(timeout=300)
        holder.join(timeout=60)
    assert "b1: CANCELLED" in finished and [f for f in finished if not f.startswith("b1")] == ["i", "b2"], finished
    assert sum(events["i"]) == 4 and sum(events["b2"]) == 48


@pytest.mark.slow
def test_joined_stack_stops_and_leaves_the_cluster(joined, stack):
    """SIGTERM stops the joined stack: its actors leave the cluster, which keeps running with its own stack."""
    (ns,) = joined.namespaces
    joined.proc.send_signal(signal.SIGTERM)
    assert joined.proc.wait(timeout=120) == 0
    assert "shutting down" in joined.log.read_text()
    deadline = time.monotonic() + 60
    while any(a["namespace"] == ns for a in ray.util.list_named_actors(all_namespaces=True)):
        assert time.monotonic() < deadline, "the joined stack's actors are still there"
        time.sleep(0.2)
    with Client(stack.address) as client:
        assert len(client.complete(generate_request("Hi", sampling={"max_tokens": 2}), timeout=60).token_ids) == 2


# ---- the scaling flags, through a `baton serve` of its own ------------------------------------------------------


def _named_workers(namespace: str) -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(("prefill-", "decode-"))}


@pytest.mark.slow
def test_scaling_flags_add_and_remove_a_decode_worker(stack, tmp_path):
    """--decode-max 2 --scale-up-load 1 --scale-up-after 0 --scale-down-after 2 (joining the session's cluster by
    its address, as `--address HEAD:6379` would): two streams on one decode worker with room for one sequence
    add decode-1; both answers come back whole; two seconds after a worker's load ends it is drained and gone,
    and the pool is back at its minimum. --prefill-max 1 keeps the prefill pool at one worker throughout."""
    before = {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)}
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("BATON_TOKEN", "BATON_REDIS_URL", "BATON_GATEWAY_KEY", "BATON_AUTH_TOKENS", "RAY_ADDRESS")}
    argv = [sys.executable, "-m", "baton.cli", "serve", "--address", ray.get_runtime_context().gcs_address,
            "--port", "0", "--http-port", "-1", "--metrics-port", "-1", "--kv-cache-memory", "0.25",
            "--max-batch", "1", "--no-prefix-cache", "--threads-per-worker", "1", "--no-pin-cpus",
            "--prefill-max", "1", "--decode-max", "2", "--scale-up-load", "1", "--scale-up-after", "0",
            "--scale-down-after", "2"]
    with serve_process(argv, env, log_path) as (proc, address):
        (ns,) = {a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)} - before
        assert _named_workers(ns) == {"prefill-0", "decode-0"}
        answers: list[list[int]] = []

        def stream() -> None:
            with Client(address) as client:
                ids = [t for m in client.stream(generate_request("Count to a thousand:", sampling={
                    "max_tokens": 400, "temperature": 0, "ignore_eos": True}), timeout=600) for t in m.token_ids]
            answers.append(ids)

        streams = [threading.Thread(target=stream) for _ in range(2)]
        for t in streams:
            t.start()
        try:
            deadline = time.monotonic() + 300
            # The event is printed once decode-1 has loaded and joined the router (its actor exists earlier, and
            # the decision was taken while both streams were on decode-0).
            while "decode pool: added decode-1" not in log_path.read_text():
                assert time.monotonic() < deadline, "the pool did not grow\n" + log_path.read_text()[-3000:]
                time.sleep(0.2)
        finally:
            for t in streams:
                t.join(timeout=600)
        assert [len(a) for a in answers] == [400, 400]
        assert re.search(r"decode pool: added decode-1 \(\d+\.\d requests per worker", log_path.read_text())
        # Back to one decode worker: whichever went idle first (a stream the router held for room may have
        # gone to decode-1) is drained and removed.
        deadline = time.monotonic() + 120
        while len(_named_workers(ns)) != 2:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        (decode,) = _named_workers(ns) - {"prefill-0"}
        removed = ({"decode-0", "decode-1"} - {decode}).pop()
        assert f"decode pool: removed {removed} (idle for 2 s)" in log_path.read_text()
        assert "prefill pool: added" not in log_path.read_text()
    assert proc.returncode == 0


# ---- `baton bench` against the session's stack ----------------------------------------------------------------


def _bench(tmp_path, name: str, *argv: str) -> dict:
    path = tmp_path / "results" / f"{name}.json"
    assert main(["bench", *argv, "--json", str(path)]) == 0
    return json.loads(path.read_text())


@pytest.mark.slow
def test_bench_plots_dir_label_and_slo_flags(stack, tmp_path, capsys):
    target = ["--target", f"grpc://{stack.address}", "--requests", "2", "--warmup", "0", "--prompt-tokens", "16",
              "--output-tokens", "4"]
    res = _bench(tmp_path, "lenient", *target, "--slo-ttft", "600", "--slo-tpot", "60", "--slo-percentile", "50",
                 "--label", "documented run", "--plots", str(tmp_path / "plots"))
    assert res["label"] == "documented run"
    slo = {"ttft_s": 600.0, "tpot_s": 60.0, "percentile": 50.0}
    (level,) = res["levels"]
    assert res["slo"] == slo and level["stats"]["slo"] == slo
    s = level["stats"]
    assert s["completed"] == 2 and s["slo_met_share"] == 1.0 and s["slo_met_at_percentile"] is True
    assert s["goodput_requests_per_s"] == s["requests_per_s"] > 0
    assert "SLO (TTFT <= 600.0 s, TPOT <= 60.0 s at p50) met; 100% of requests within it" in capsys.readouterr().out
    # --plots: the PNGs go there, named after the JSON file, and not beside the JSON.
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "lenient-goodput.png", "lenient-latency.png", "lenient-scatter.png"]
    assert all(p.read_bytes()[:8] == PNG for p in (tmp_path / "plots").iterdir())
    assert [p.name for p in (tmp_path / "results").iterdir()] == ["lenient.json"]

    # A TTFT bound no request meets: no goodput, and not met at the percentile; without --plots the PNGs go
    # beside the JSON.
    res = _bench(tmp_path, "tight", *target, "--slo-ttft", "0.000001", "--slo-percentile", "99")
    s = res["levels"][0]["stats"]
    assert res["slo"] == {"ttft_s": 0.000001, "tpot_s": 0.1, "percentile": 99.0}
    assert s["completed"] == 2 and s["slo_met_share"] == 0 and s["goodput_requests_per_s"] == 0
    assert s["slo_met_at_percentile"] is False
    assert (tmp_path / "results" / "tight-latency.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_bench_duration_stops_sending(stack, tmp_path):
    """--duration S: open loop, only the arrivals of the first S seconds are sent; closed loop, no client sends
    once S seconds have passed since the first measured request."""
    target = ["--target", f"grpc://{stack.address}", "--warmup", "0", "--prompt-tokens", "8", "--output-tokens", "2"]
    res = _bench(tmp_path, "open", *target, "--rate", "40", "--requests", "200", "--duration", "0.5")
    expected = sum(t < 0.5 for t in poisson_times(40.0, 200, seed=0))
    s = res["levels"][0]["stats"]
    assert 0 < expected < 200 and s["requests"] == expected and s["completed"] == expected
    res = _bench(tmp_path, "closed", *target, "--concurrency", "1", "--requests", "300", "--duration", "0.3")
    reqs = res["levels"][0]["requests"]
    assert 1 <= len(reqs) < 300 and all(r["error"] is None for r in reqs)
    # Each send decided before the window closed: it started at most one request's time after it.
    slack = max(r["e2e_s"] for r in reqs)
    assert all(r["sent_s"] <= 0.3 + slack for r in reqs)


# ---- `baton bench` against an OpenAI-compatible server that sends no usage ------------------------------------


@pytest.fixture(scope="module")
def no_usage_server(tiny_llama_dir):
    from baton.engine.engine import LLMEngine
    from tests.openai_server import OpenAIServer

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu",
                                    kv_cache_memory=16 << 20, block_size=4))
    server = OpenAIServer(engine, model="tiny-llama", usage=False).start()
    yield server
    server.stop()


def test_bench_counts_one_token_per_chunk_without_usage(no_usage_server, tmp_path, monkeypatch):
    monkeypatch.delenv("BATON_TOKEN", raising=False)
    before = no_usage_server.chunks
    res = _bench(tmp_path, "oai", "--target", no_usage_server.url, "--concurrency", "2", "--requests", "3",
                 "--warmup", "0", "--prompt-tokens", "10:20", "--output-tokens", "5", "--token", TOKEN)
    assert res["model"] == "tiny-llama"
    s = res["levels"][0]["stats"]
    assert s["completed"] == 3 and not s["errors"]
    reqs = res["levels"][0]["requests"]
    # No usage chunk: every streamed text chunk counts as one token (this server streams one token per chunk).
    assert [r["output_tokens"] for r in reqs] == [5, 5, 5]
    assert s["output_tokens"] == no_usage_server.chunks - before == 15
    assert all(len(r["itl_s"]) == 4 and r["tpot_s"] is not None and r["cached_tokens"] == 0 for r in reqs)
    # The prompt size stays the workload's own count (the server did not say).
    assert all(8 <= r["prompt_tokens"] <= 22 for r in reqs)
    # --token goes to HTTP targets too, as a bearer token.
    assert set(no_usage_server.authorizations[-4:]) == {f"Bearer {TOKEN}"}


def test_bench_sends_baton_token_to_http_targets(no_usage_server, tmp_path, monkeypatch):
    """README: clients send `authorization: Bearer TOKEN` (--token, BATON_TOKEN); bench --help: BATON_TOKEN is
    the default for HTTP targets too."""
    monkeypatch.setenv("BATON_TOKEN", TOKEN)
    seen = len(no_usage_server.authorizations)
    _bench(tmp_path, "env", "--target", no_usage_server.url, "--requests", "1", "--warmup", "0", "--prompt-tokens",
           "10", "--output-tokens", "2")
    assert set(no_usage_server.authorizations[seen:]) == {f"Bearer {TOKEN}"}


# ---- `baton bench` against llama.cpp's server, as recorded ---------------------------------------------------

LLAMA = Path(__file__).parent / "data" / "llama_server"  # recorded by its record.py from llama.cpp's llama-server


def _sse_events(body: bytes) -> list[dict]:
    return [json.loads(line[5:]) for line in body.decode().splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def _without_usage(response: bytes) -> bytes:
    """The recorded stream as a server that ignores stream_options.include_usage sends it: no usage chunk, and
    no usage field on any other chunk."""
    head, body = response.split(b"\r\n\r\n", 1)
    lines = []
    for line in body.decode().split("\n"):
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            event = json.loads(line[5:])
            event.pop("usage", None)
            if not event.get("choices"):
                continue
            line = "data: " + json.dumps(event)
        lines.append(line)
    return head + b"\r\n\r\n" + "\n".join(lines).encode()


class _Replay:
    """An HTTP server that answers GET /v1/models and POST /v1/completions with recorded responses, whatever the
    request asked, and keeps the bodies it was sent."""

    def __init__(self, models: bytes, completions: bytes) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.bodies: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, response: bytes) -> None:
                head, body = response.split(b"\r\n\r\n", 1)
                self.wfile.write(head + b"\r\nConnection: close\r\n\r\n" + body)
                self.close_connection = True

            def do_GET(self) -> None:
                self._send(models)

            def do_POST(self) -> None:
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self._send(completions)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("usage", [True, False], ids=["as-recorded", "without-usage"])
def test_bench_reads_llama_cpp_servers_stream(usage, tmp_path, monkeypatch):
    """`baton bench --target http://...` against llama.cpp's server, replayed from a recording of what it sent
    for the request the bench builds: the model id from /v1/models; tokens, prompt size and cached tokens from
    its usage chunk; one token time per text chunk. Without the usage chunk (servers that ignore
    stream_options), one token per text chunk and the workload's own prompt size."""
    monkeypatch.delenv("BATON_TOKEN", raising=False)
    models, completions = (LLAMA / "models.http").read_bytes(), (LLAMA / "completions.http").read_bytes()
    assert completions.startswith(b"HTTP/1.1 200") and b"text/event-stream" in completions.split(b"\r\n\r\n")[0]
    events = _sse_events(completions.split(b"\r\n\r\n", 1)[1])
    recorded = next(e["usage"] for e in events if e.get("usage"))
    texts = sum(1 for e in events if e.get("choices") and e["choices"][0].get("text"))
    assert recorded["completion_tokens"] >= texts >= 2
    replay = _Replay(models, completions if usage else _without_usage(completions))
    try:
        res = _bench(tmp_path, "llama", "--target", replay.url, "--requests", "2", "--concurrency", "1", "--warmup",
                     "0", "--prompt-tokens", "30", "--output-tokens", str(recorded["completion_tokens"]))
    finally:
        replay.close()
    assert res["model"] == json.loads(models.split(b"\r\n\r\n", 1)[1])["data"][0]["id"]
    assert [b["model"] for b in replay.bodies] == [res["model"]] * 2
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} for b in replay.bodies)
    s = res["levels"][0]["stats"]
    assert s["completed"] == 2 and not s["errors"]
    for r in res["levels"][0]["requests"]:
        assert len(r["itl_s"]) == texts - 1 and r["tpot_s"] is not None
        if usage:
            assert r["output_tokens"] == recorded["completion_tokens"]
            assert r["prompt_tokens"] == recorded["prompt_tokens"]
        else:
            assert r["output_tokens"] == texts
            assert 25 <= r["prompt_tokens"] <= 35  # the workload's own count of its 30-token prompt

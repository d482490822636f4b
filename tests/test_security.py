"""Access control with certificates made on the fly: TLS on every gRPC server, mutual TLS between router and
workers, bearer tokens on the public API, Redis with a password and over TLS."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import ray
from grpc_health.v1 import health_pb2, health_pb2_grpc

from baton.api.client import Client, client_channel
from baton.security import Tokens
from baton.services.prefix_index import IndexUnavailable, RedisIndex
from baton.services.redis_server import RedisServer, free_port
from baton.v1 import generation_pb2 as pb
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc
from tests.certs import make_certs

FULL = "full-access-token-0123456789"
TOKENIZE_ONLY = "tokenize-only-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_tokens_file_and_environment(tmp_path):
    f = tmp_path / "tokens"
    f.write_text(f"# comment\n{FULL}\n{TOKENIZE_ONLY} Tokenize, ListModels  # limited\n")
    t = Tokens.load(str(f), env="env-token-abcdefghijkl")
    assert t.check(FULL) == frozenset({"*"}) and t.check("env-token-abcdefghijkl") == frozenset({"*"})
    assert t.check(TOKENIZE_ONLY) == frozenset({"Tokenize", "ListModels"})
    assert t.check("wrong-token-0123456789") is None and t.check("") is None
    assert Tokens.load(None, env="") is None
    f.write_text("short\n")
    with pytest.raises(ValueError, match="16 characters"):
        Tokens.load(str(f), env="")


@pytest.fixture(scope="module")
def secure_stack(stack, certs, tmp_path_factory):
    """A second stack in the session's Ray: TLS everywhere, mutual TLS inside, tokens on the public API."""
    from baton.config import ServeConfig
    from baton.security import TLSConfig
    from baton.serve import Stack
    from tests.stack_config import STACK_ENGINE

    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"{FULL}\n{TOKENIZE_ONLY} Tokenize,ListModels\n")
    st = Stack(ServeConfig(engine=STACK_ENGINE, port=0, redis_url="memory", metrics_port=None, http_port=0,
                           tls=TLSConfig(certs["cert"], certs["key"], certs["ca"]), auth_tokens_file=str(tokens)))
    st.start()
    yield st
    st.stop()


def _tls_channel(address: str, ca: str, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    read = lambda p: Path(p).read_bytes() if p else None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(ca), read(key), read(cert)))


def _call(fn):
    try:
        return "OK", fn()
    except grpc.RpcError as e:
        return e.code().name, e.details()


@pytest.mark.slow
def test_public_api_needs_tls_and_a_token(secure_stack, certs, monkeypatch):
    monkeypatch.delenv("BATON_TOKEN", raising=False)  # a Client given no token sends none
    addr = secure_stack.address
    with client_channel(addr, certs["ca"]) as ch:  # one TLS channel, a client per token
        full, anonymous = Client(channel=ch, token=FULL), Client(channel=ch)
        wrong, limited = Client(channel=ch, token="nope-0123456789abcdef"), Client(channel=ch, token=TOKENIZE_ONLY)
        req = pb.GenerateRequest(prompt="Say hi.", sampling=pb.SamplingParams(max_tokens=4, temperature=0))
        ok = list(full.stream(req, timeout=120))
        assert sum(len(m.token_ids) for m in ok) == 4
        assert _call(lambda: list(anonymous.stream(req, timeout=30)))[0] == "UNAUTHENTICATED"
        code, msg = _call(lambda: list(wrong.stream(req, timeout=30)))
        assert code == "UNAUTHENTICATED" and "not valid" in msg
        code, msg = _call(lambda: list(limited.stream(req, timeout=30)))
        assert code == "PERMISSION_DENIED" and "Generate" in msg
        assert _call(lambda: limited.tokenize("hi", timeout=30))[0] == "OK"
        # LoRA admin methods: a token without them is refused before anything is read; one with every method
        # reaches the router, which refuses loading at run time without --lora-root
        code, msg = _call(lambda: limited.load_adapter("a", "/tmp", timeout=30))
        assert code == "PERMISSION_DENIED" and "LoadAdapter" in msg
        code, msg = _call(lambda: full.load_adapter("a", "/tmp", timeout=30))
        assert code == "FAILED_PRECONDITION" and "--lora-root" in msg
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    with Client(addr, tls_ca=certs["other-ca"]) as client:  # a server the client cannot verify
        code, _ = _call(lambda: client.list_models(timeout=10))
        assert code == "UNAVAILABLE"
    with Client(addr) as client:  # plaintext to a TLS port
        code, _ = _call(lambda: client.list_models(timeout=10))
        assert code == "UNAVAILABLE"


@pytest.mark.slow
def test_workers_accept_only_the_routers_certificate(secure_stack, certs):
    info = ray.get(secure_stack.prefill[0].info.remote())
    release = wpb.ReleaseRequest(request_id="nothing")
    with _tls_channel(info.address, certs["ca"]) as ch:  # TLS, but no client certificate
        assert _call(lambda: wgrpc.PrefillWorkerStub(ch).Release(release, timeout=10))[0] == "UNAVAILABLE"
    with grpc.insecure_channel(info.address) as ch:
        assert _call(lambda: wgrpc.PrefillWorkerStub(ch).Release(release, timeout=10))[0] == "UNAVAILABLE"
    with _tls_channel(info.address, certs["ca"], certs["cert"], certs["key"]) as ch:  # what the router has
        status, resp = _call(lambda: wgrpc.PrefillWorkerStub(ch).Release(release, timeout=10))
        assert status == "OK" and resp.released is False


def test_redis_with_a_password_and_over_tls(certs):
    with RedisServer(password="s3cret-redis-password") as server:
        index = RedisIndex(server.url, "ns", ttl_s=30)
        index.update("w1", {b"h" * 16: 1.0}, [])
        assert index.lookup([b"h" * 16]) == {"w1": 1}
        wrong = RedisIndex(server.url.replace("s3cret", "wrong"), "ns", ttl_s=30)
        with pytest.raises(IndexUnavailable):
            wrong.lookup([b"h" * 16])
    with RedisServer(tls=(certs["cert"], certs["key"], certs["ca"])) as server:
        assert server.url.startswith("rediss://")
        index = RedisIndex(server.url, "ns", ttl_s=30)
        index.update("w1", {b"t" * 16: 1.0}, [])
        assert index.lookup([b"t" * 16]) == {"w1": 1}
        plain = RedisIndex(server.url.replace("rediss://", "redis://").split("?")[0], "ns", ttl_s=30)
        with pytest.raises(IndexUnavailable):
            plain.lookup([b"t" * 16])


def test_http_api_is_https_and_takes_the_same_tokens(secure_stack, certs):
    """With TLS the gateway serves HTTPS with the stack's certificate (a token never crosses in the clear) and
    passes the bearer token on: the router's tokens file decides, as for gRPC."""
    import openai

    assert secure_stack.gateway.url.startswith("https://")

    import ssl

    trusted = ssl.create_default_context(cafile=certs["ca"])

    def client(key: str, verify=trusted):
        return openai.OpenAI(base_url=secure_stack.gateway.url, api_key=key, max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(verify=verify))

    with pytest.raises(openai.APIConnectionError):  # a certificate nobody vouched for is refused
        client(FULL, verify=True).models.list()

    msgs = [{"role": "user", "content": "Say hi."}]
    model = client(FULL).models.list().data[0].id
    r = client(FULL).chat.completions.create(model=model, messages=msgs, max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        client("nope-0123456789abcdef").chat.completions.create(model=model, messages=msgs, max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        client("nope-0123456789abcdef").models.list()
    with pytest.raises(openai.PermissionDeniedError):
        client(TOKENIZE_ONLY).chat.completions.create(model=model, messages=msgs, max_tokens=3)


def test_standalone_gateway_serves_https_in_front_of_a_tls_router(secure_stack, certs):
    """`baton gateway --router HOST:PORT --tls-cert ... --tls-ca ...`: TLS to the router, HTTPS to clients."""
    import ssl
    import subprocess
    import sys

    import openai

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "baton.cli", "gateway", "--router", secure_stack.address,
                             "--http-port", str(port), "--tls-cert", certs["cert"], "--tls-key", certs["key"],
                             "--tls-ca", certs["ca"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert f"OpenAI-compatible API at https://127.0.0.1:{port}/v1" in proc.stdout.readline()
        client = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=FULL, max_retries=0, timeout=120,
                               http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=certs["ca"])))
        r = client.completions.create(model=client.models.list().data[0].id, prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0

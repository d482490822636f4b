"""Access control: TLS for every gRPC server (mutual TLS between the router and the workers when a CA
is given) and bearer tokens on the public API.

Tokens come from a file (``--auth-tokens-file``: one token per line, optionally followed by the
methods it may call, e.g. ``s3cret Generate,Tokenize``; ``#`` starts a comment) or from
``BATON_AUTH_TOKENS`` (comma-separated, all methods). A call without a valid ``authorization: Bearer
TOKEN`` gets UNAUTHENTICATED; a valid token calling a method it may not gets PERMISSION_DENIED. Tokens
are compared in constant time (every configured token is compared, with ``hmac.compare_digest``).
Health checks stay open (load balancers probe them).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
ALL = frozenset({"*"})


@dataclass(frozen=True)
class TLSConfig:
    cert: str  # PEM certificate chain of this server (and, for mutual TLS, of the router as a client)
    key: str  # PEM private key
    ca: str | None = None  # PEM CA: verifies the peer; on worker servers it makes client certificates required
    server_name: str | None = None  # the name worker certificates carry, when not their address

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"TLS {name} file {path!r} does not exist")

    def _read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        return Path(path).read_bytes() if path else None

    def server_credentials(self, require_client_cert: bool = False) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self._read("key"), self._read("cert"))],
                                           root_certificates=self._read("ca") if require_client_cert else None,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """For the router's channels to workers: verify them by the CA (without one, by our own
        certificate, which the workers share) and present our certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self._read("ca") or self._read("cert"),
                                            private_key=self._read("key"), certificate_chain=self._read("cert"))


def add_port(server: grpc.Server, address: str, tls: TLSConfig | None, require_client_cert: bool = False) -> int:
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials(require_client_cert))


def channel(address: str, tls: TLSConfig | None, options: list | None = None) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options = [*(options or []), ("grpc.ssl_target_name_override", tls.server_name)]
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


@dataclass(frozen=True)
class Tokens:
    """token -> the methods it may call (``*``: all)."""

    grants: Mapping[str, frozenset[str]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | None = None, env: str | None = None) -> Tokens | None:
        """From a file and/or ``BATON_AUTH_TOKENS``; None when neither names a token (auth off)."""
        grants: dict[str, frozenset[str]] = {}
        if path:
            for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                token, _, methods = line.partition(" ")
                if len(token) < 16:
                    raise ValueError(f"{path}:{lineno}: tokens must be at least 16 characters")
                grants[token] = frozenset(m.strip() for m in methods.split(",") if m.strip()) or ALL
        env = os.environ.get("BATON_AUTH_TOKENS") if env is None else env
        for token in filter(None, (t.strip() for t in (env or "").split(","))):
            if len(token) < 16:
                raise ValueError("BATON_AUTH_TOKENS: tokens must be at least 16 characters")
            grants[token] = ALL
        return cls(grants) if grants else None

    def check(self, presented: str) -> frozenset[str] | None:
        """The grants of ``presented``, or None; compares against every token whatever matches."""
        found = None
        for token, methods in self.grants.items():
            if hmac.compare_digest(token.encode(), presented.encode()):
                found = methods
        return found


def bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


# The HTTP gateway names the client it speaks for, so per-client limits count HTTP clients apart instead
# of as one. The router believes the name only beside the gateway key it shares with its gateways
# (``BATON_GATEWAY_KEY``, else one made per stack); without it any caller could pick a fresh name per call.
FORWARDED_FOR = "baton-forwarded-for"
GATEWAY_KEY = "baton-gateway-key"


def shared_gateway_key() -> str | None:
    """``BATON_GATEWAY_KEY``, checked (ValueError when shorter than 16 characters); None when unset."""
    key = os.environ.get("BATON_GATEWAY_KEY") or None
    if key is not None and len(key) < 16:
        raise ValueError("BATON_GATEWAY_KEY must be at least 16 characters")
    return key


def gateway_key() -> str:
    """The key a stack's router and gateways share: ``BATON_GATEWAY_KEY``, else a new random one."""
    return shared_gateway_key() or secrets.token_urlsafe(24)


def forwarded_client(metadata, key: str | None) -> str | None:
    """The client a gateway forwarded this call for, when it showed ``key``; else None."""
    if key is None:
        return None
    shown = name = None
    for k, value in metadata or ():
        if k == GATEWAY_KEY and isinstance(value, str):
            shown = value
        elif k == FORWARDED_FOR and isinstance(value, str):
            name = value[:64]
    if shown is None or name is None or not hmac.compare_digest(shown.encode(), key.encode()):
        return None
    return "http:" + name


def token_client_id(token: str) -> str:
    """A stable, non-secret name for a token (per-client limits, logs)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:12]


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens

    def intercept_service(self, continuation, details):
        method = details.method
        if method.startswith(OPEN_SERVICES):
            return continuation(details)
        token = bearer(details.invocation_metadata)
        if token is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "missing credentials: send 'authorization: Bearer TOKEN'",
                         continuation(details))
        grants = self.tokens.check(token)
        if grants is None:
            return _deny(grpc.StatusCode.UNAUTHENTICATED, "the bearer token is not valid", continuation(details))
        name = method.rsplit("/", 1)[-1]
        if "*" not in grants and name not in grants:
            return _deny(grpc.StatusCode.PERMISSION_DENIED, f"this token may not call {name}", continuation(details))
        return continuation(details)


def _deny(code: grpc.StatusCode, message: str, like=None):
    """A handler that refuses the call, of the same kind (streaming or not) as ``like``."""
    def abort(request_or_iterator, context):
        context.abort(code, message)

    def abort_stream(request_or_iterator, context):
        context.abort(code, message)
        yield  # a generator: the kind a streaming response needs

    req_stream = bool(like and like.request_streaming)
    resp_stream = like is None or like.response_streaming  # unknown: most public calls stream
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(req_stream, resp_stream)](abort_stream if resp_stream else abort, request_deserializer=lambda b: b)


__all__ = ["FORWARDED_FOR", "GATEWAY_KEY", "AuthInterceptor", "TLSConfig", "Tokens", "add_port", "bearer", "channel",
           "forwarded_client", "gateway_key", "shared_gateway_key", "token_client_id"]

"""The gateway's HTTP server: uvicorn on its own thread and event loop, beside the router."""

from __future__ import annotations

import threading
import time

import uvicorn

from baton.security import TLSConfig
from baton.services.gateway.app import create_app


class Gateway:
    def __init__(self, router_address: str, host: str, port: int, max_body_bytes: int,
                 tls: TLSConfig | None = None, gateway_key: str | None = None) -> None:
        """port 0 picks a free port (``self.port`` says which once started). With ``tls`` the router is
        reached over TLS and HTTPS is served with the same certificate: a bearer token never crosses the
        network in the clear. ``gateway_key``: the router's, to name each HTTP client (its address) for
        the router's per-client limits."""
        config = uvicorn.Config(create_app(router_address, max_body_bytes, tls, gateway_key), host=host, port=port,
                                log_level="warning", lifespan="off",
                                ssl_certfile=tls.cert if tls else None, ssl_keyfile=tls.key if tls else None)
        self.scheme = "https" if tls else "http"
        self.server = uvicorn.Server(config)
        self.host = host
        self.port: int | None = None
        self._thread = threading.Thread(target=self.server.run, name="http-gateway", daemon=True)

    def start(self, timeout_s: float = 30.0) -> Gateway:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP gateway did not start on {self.host}")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"{self.scheme}://{self.address}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)

"""Drives load at a server and records every request: clients for Baton (gRPC) and OpenAI-compatible
servers (HTTP ``/v1/completions`` with streaming), closed and open loops, warm-up, progress."""

from __future__ import annotations

import http.client
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlparse

import grpc

from baton.api.client import Client, generate_request
from baton.bench.report import RequestRecord
from baton.bench.workloads import BenchRequest

Send = Callable[[BenchRequest, float], RequestRecord]  # (request, run start on the perf clock) -> record


class BatonClient:
    """``grpc://HOST:PORT``: baton.v1.Generation/Generate, streamed; greedy, EOS ignored."""

    def __init__(self, address: str, timeout_s: float = 600.0, tls_ca: str | None = None,
                 token: str | None = None) -> None:
        self.client = Client(address, tls_ca=tls_ca, token=token)
        self.timeout_s = timeout_s

    def __call__(self, req: BenchRequest, t0: float) -> RequestRecord:
        rec = RequestRecord(req.id, req.kind, time.perf_counter() - t0, prompt_tokens=req.prompt_tokens)
        msg = generate_request(req.prompt, request_id=f"bench-{req.id}-{time.monotonic_ns()}",
                               sampling={"max_tokens": req.max_tokens, "temperature": 0.0, "ignore_eos": True})
        try:
            for out in self.client.generate(msg, timeout=self.timeout_s):
                now = time.perf_counter() - t0
                rec.token_times += [now] * len(out.token_ids)
                rec.output_tokens += len(out.token_ids)
                if out.HasField("usage"):
                    rec.prompt_tokens = out.usage.prompt_tokens
                    rec.cached_tokens = out.usage.cached_prompt_tokens
                    rec.spec_drafts = out.usage.spec_drafts
                    rec.spec_draft_tokens = out.usage.spec_draft_tokens
                    rec.spec_accepted_tokens = out.usage.spec_accepted_tokens
        except grpc.RpcError as e:
            rec.error, rec.detail = e.code().name, (e.details() or "")[:200]
        rec.done = time.perf_counter() - t0
        return rec

    def close(self) -> None:
        self.client.close()


class OpenAIClient:
    """``http://HOST:PORT``: POST /v1/completions with ``stream: true`` (llama.cpp's server, vLLM, SGLang).
    Output tokens: the server's usage when it sends one, else one per streamed chunk."""

    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 600.0,
                 token: str | None = None) -> None:
        u = urlparse(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"target {base_url!r}: want http://HOST:PORT")
        self.https, self.host = u.scheme == "https", u.hostname
        self.port = u.port or (443 if self.https else 80)
        self.prefix = u.path.rstrip("/")
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.model = model or self._first_model()

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def _first_model(self) -> str:
        conn = self._conn()
        try:
            conn.request("GET", f"{self.prefix}/v1/models", headers=self.headers)
            resp = conn.getresponse()
            data = json.loads(resp.read() or b"{}") if resp.status == 200 else {}
        except (OSError, ValueError):
            data = {}
        finally:
            conn.close()
        models = data.get("data") or []
        return models[0]["id"] if models and "id" in models[0] else "default"

    def __call__(self, req: BenchRequest, t0: float) -> RequestRecord:
        rec = RequestRecord(req.id, req.kind, time.perf_counter() - t0, prompt_tokens=req.prompt_tokens)
        body = json.dumps({"model": self.model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
                           "temperature": 0.0, "ignore_eos": True, "stream_options": {"include_usage": True}})
        conn = self._conn()
        chunks, usage = 0, None
        try:
            conn.request("POST", f"{self.prefix}/v1/completions", body=body,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream", **self.headers})
            resp = conn.getresponse()
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                rec.detail = resp.read(200).decode("utf-8", "replace")
            else:
                for raw in resp:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if obj.get("usage"):
                        usage = obj["usage"]
                    choices = obj.get("choices") or []
                    if choices and choices[0].get("text"):
                        rec.token_times.append(time.perf_counter() - t0)
                        chunks += 1
        except (OSError, ValueError, http.client.HTTPException) as e:
            rec.error, rec.detail = type(e).__name__, str(e)[:200]
        finally:
            conn.close()
        rec.output_tokens = max(chunks, int(usage.get("completion_tokens", 0)) if usage else 0)
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
            details = usage.get("prompt_tokens_details") or {}
            rec.cached_tokens = int(details.get("cached_tokens", 0) or 0)
        rec.done = time.perf_counter() - t0
        return rec

    def close(self) -> None:
        pass


def make_client(target: str, model: str | None = None, tls_ca: str | None = None, token: str | None = None):
    if target.startswith("grpc://"):
        return BatonClient(target.removeprefix("grpc://"), tls_ca=tls_ca, token=token)
    if target.startswith(("http://", "https://")):
        return OpenAIClient(target, model, token=token or os.environ.get("BATON_TOKEN"))
    raise ValueError(f"target {target!r}: want grpc://HOST:PORT (Baton) or http://HOST:PORT (OpenAI-compatible)")


class Progress:
    """One status line on stderr, redrawn twice a second (a new line every 10 s when not a terminal)."""

    def __init__(self, label: str, total: int | None, stream=sys.stderr) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._tty = hasattr(stream, "isatty") and stream.isatty()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._draw(final=True)

    def add(self, rec: RequestRecord) -> None:
        with self._lock:
            self.done += 1
            self.errors += rec.error is not None

    def _run(self) -> None:
        period = 0.5 if self._tty else 10.0
        while not self._stop.wait(period):
            self._draw()

    def _draw(self, final: bool = False) -> None:
        total = f"/{self.total}" if self.total else ""
        line = (f"{self.label}: {self.done}{total} requests, {self.errors} errors, "
                f"{time.monotonic() - self._t0:.0f} s")
        if self._tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def closed_loop(send: Send, requests: Sequence[BenchRequest], concurrency: int, warmup: int = 0,
                duration_s: float | None = None, label: str = "", ramp_s: float = 0.0
                ) -> tuple[list[RequestRecord], float]:
    """``concurrency`` clients, each sending its next request when the last one ends. The first ``warmup``
    requests warm the server up in the same loop and are left out: the clients run on into the measured
    requests, so the window (from the first measured send) sees the load's steady state rather than
    every client starting at once. ``ramp_s``: client k starts ``k * ramp_s / concurrency`` seconds in,
    so the clients do not all send at the same moment (which requests of equal length can keep doing,
    cycle after cycle)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if ramp_s < 0:
        raise ValueError("ramp-up must be >= 0 seconds")
    todo = iter(enumerate(requests))
    lock = threading.Lock()
    records: list[RequestRecord] = []
    base = time.perf_counter()
    window: list[float] = []  # [start of the measured window], once the first measured request is sent

    with Progress(label or f"{concurrency} clients", len(requests) - warmup) as progress:
        def client(k: int) -> None:
            time.sleep(k * ramp_s / concurrency)
            while True:
                with lock:
                    i, req = next(todo, (None, None))
                    if req is None:
                        return
                    if i == warmup:
                        window.append(time.perf_counter())
                    if duration_s is not None and window and time.perf_counter() > window[0] + duration_s:
                        return
                rec = send(req, base)
                if i >= warmup:
                    with lock:
                        records.append(rec)
                    progress.add(rec)

        threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    start = window[0] if window else time.perf_counter()
    for rec in records:  # times from the start of the window
        _shift(rec, start - base)
    return records, time.perf_counter() - start


def _shift(rec: RequestRecord, dt: float) -> None:
    rec.sent -= dt
    rec.token_times = [t - dt for t in rec.token_times]
    if rec.done is not None:
        rec.done -= dt


def poisson_times(rate: float, n: int, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` Poisson arrivals at ``rate`` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def open_loop(send: Send, requests: Sequence[BenchRequest], rate: float, seed: int = 0, warmup: int = 0,
              duration_s: float | None = None, label: str = "") -> tuple[list[RequestRecord], float]:
    """Poisson arrivals at ``rate`` per second, each request on its own thread whatever the server's
    state (an open loop), for at most ``duration_s`` of arrivals. Warm-up requests go first, closed."""
    _drain(send, requests[:warmup], max(1, min(4, warmup)))
    work = list(requests[warmup:])
    times = poisson_times(rate, len(work), seed)
    if duration_s is not None:
        work = [r for r, t in zip(work, times) if t < duration_s]
    records: list[RequestRecord] = []
    lock = threading.Lock()
    threads = []
    t0 = time.perf_counter()
    with Progress(label or f"{rate:g} req/s", len(work)) as progress:
        def one(req: BenchRequest) -> None:
            rec = send(req, t0)
            with lock:
                records.append(rec)
            progress.add(rec)

        for req, at in zip(work, times):
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one, args=(req,), daemon=True)
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    return records, time.perf_counter() - t0


def _drain(send: Send, requests: Sequence[BenchRequest], concurrency: int) -> None:
    if not requests:
        return
    todo, lock, t0 = iter(requests), threading.Lock(), time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                req = next(todo, None)
            if req is None:
                return
            send(req, t0)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


__all__ = ["BatonClient", "OpenAIClient", "Progress", "closed_loop", "make_client", "open_loop", "poisson_times"]

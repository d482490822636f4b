"""What prefill and decode workers share: an engine on its own thread, and proto conversions."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any, TypeVar

import grpc
import ray
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton import metrics, security
from baton.engine.engine import EngineConfig, LLMEngine, RequestOutput
from baton.engine.sampling import SamplingParams
from baton.engine.sequence import Priority
from baton.security import TLSConfig
from baton.services.registry import register_self, unregister_self
from baton.tracing import Tracing, TracingConfig
from baton.v1 import generation_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")


class RequestCancelled(Exception):
    """Put on a request's output queue when it is aborted, so that a thread waiting on it wakes up."""


class EngineLoop:
    """Runs one LLMEngine on a dedicated thread. Other threads never touch the engine: they send
    commands (run on the engine thread between steps) and read per-request output queues.

    Admission wait: when the engine is idle and a request arrives, the loop keeps collecting
    arrivals for up to ``admission_wait`` seconds before the first step, so that requests arriving
    together start in the same batch. While busy, arrivals join at the next step without waiting.
    """

    def __init__(self, engine: LLMEngine, admission_wait: float = 0.015,
                 on_step: Callable[[LLMEngine], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        self.admission_wait = admission_wait
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, queue.Queue[RequestOutput | BaseException]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self._commands.put(run)
        return fut

    def call(self, fn: Callable[[], T], timeout: float | None = 60.0) -> T:
        """Run ``fn`` on the engine thread and return its result (or raise its exception)."""
        return self.submit(fn).result(timeout=timeout)

    def add(self, request_id: str, add: Callable[[], Any], check: Callable[[], Any] | None = None
            ) -> queue.Queue[RequestOutput | BaseException]:
        """Register an output queue for ``request_id`` and queue ``add`` (which adds the request) for the
        engine thread, without waiting for it: a long forward pass must not hold up the caller.
        ``check`` runs here first and raises InvalidRequestError for a request that cannot be served;
        anything ``add`` raises later arrives on the queue."""
        if check is not None:
            check()
        q: queue.Queue[RequestOutput | BaseException] = queue.Queue()

        def run() -> None:
            try:
                add()  # the engine refuses a request id in use
            except BaseException as e:  # noqa: BLE001 - handed to the waiting handler
                q.put(e)
                return
            self._streams[request_id] = q  # before the next step, which makes its first output

        self._commands.put(run)
        return q

    def abort(self, request_id: str) -> None:
        def run() -> None:
            self.engine.abort(request_id)
            q = self._streams.pop(request_id, None)
            if q is not None:
                q.put(RequestCancelled(request_id))

        self._commands.put(run)

    def _drain(self, block_for: float) -> None:
        deadline = time.monotonic() + block_for
        while True:
            remaining = deadline - time.monotonic()
            try:
                cmd = self._commands.get(timeout=remaining) if remaining > 0 else self._commands.get_nowait()
            except queue.Empty:
                return
            cmd()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                try:
                    cmd = self._commands.get(timeout=0.1)
                except queue.Empty:
                    continue
                cmd()
                if self.engine.has_unfinished():
                    self._drain(self.admission_wait)
            self._drain(0)
            self._dispatch(self.engine.emit_arrivals())
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails the requests, not the worker
                log.exception("engine step failed")
                for rid, q in list(self._streams.items()):
                    q.put(e)
                    self.engine.abort(rid)
                self._streams.clear()
                continue
            if self.on_step is not None:
                self.on_step(self.engine)
            self._dispatch(outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            q.put(out)
            if out.finished:
                del self._streams[out.request_id]


def sampling_from_proto(sp: pb.SamplingParams, max_tokens_default: int = 16) -> SamplingParams:
    """Proto -> SamplingParams; raises InvalidRequestError naming the field."""
    return SamplingParams(
        max_tokens=sp.max_tokens if sp.HasField("max_tokens") else max_tokens_default,
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k if sp.HasField("top_k") else 0,
        min_p=sp.min_p if sp.HasField("min_p") else 0.0,
        seed=sp.seed if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        repetition_penalty=sp.repetition_penalty if sp.HasField("repetition_penalty") else 1.0,
        presence_penalty=sp.presence_penalty if sp.HasField("presence_penalty") else 0.0,
        frequency_penalty=sp.frequency_penalty if sp.HasField("frequency_penalty") else 0.0,
        logprobs=sp.logprobs,
    )


def priority_from_proto(value: int) -> Priority:
    """Batch only when asked; unspecified and unknown values are interactive."""
    return Priority.BATCH if value == pb.PRIORITY_BATCH else Priority.INTERACTIVE


def response_from_output(out: RequestOutput) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text)
    if out.logprobs:
        resp.logprobs.extend(out.logprobs)
    if out.finished:
        resp.finish_reason = out.finish_reason or ""
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.prompt_tokens,
                                     cached_prompt_tokens=out.cached_prompt_tokens,
                                     completion_tokens=out.completion_tokens))
    return resp


class ActiveCounter:
    """How many RPC handlers are inside a block right now (a leak check: it must drain to 0)."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def __enter__(self) -> ActiveCounter:
        with self._lock:
            self._n += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._n -= 1

    @property
    def value(self) -> int:
        return self._n


def pin_process(cpus: list[int]) -> None:
    """Set the CPU affinity of every thread this process has now (Linux: one call per thread)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that has just ended
            os.sched_setaffinity(int(tid), cpus)


class WorkerBase:
    """What a worker actor is made of: an engine on its loop thread, a gRPC server with health, and a
    registration that lets the router find it. Subclasses set ``kind`` and add their servicer."""

    kind = "worker"

    def __init__(self, name: str, config: EngineConfig, threads: int | None, admission_wait: float = 0.015,
                 namespace: str | None = None, tracing: TracingConfig | None = None,
                 metrics_port: int | None = None, host: str = "127.0.0.1", tls: TLSConfig | None = None,
                 cpus: list[int] | None = None) -> None:
        """namespace: the stack's Ray namespace, where its registry and workers live. tracing: where
        spans go (None: nowhere). metrics_port: serve Prometheus metrics there (0: any free port).
        cpus: run every thread of this process on these cores (threads started later inherit them)."""
        logging.basicConfig(level=logging.INFO)
        if cpus:
            pin_process(cpus)
        if threads:
            torch.set_num_threads(threads)
        self.name = name
        self.host = host
        self.tls = tls
        self.namespace = namespace
        self.tracing = Tracing(tracing, self.kind, name)
        self.engine = LLMEngine(config)
        self.model = self.engine.model_config.name
        sched, pool = self.engine.scheduler, self.engine.pool
        metrics.engine_gauges(self.model, name, lambda: len(sched.running), lambda: len(sched.waiting), pool.usage)
        self.metrics_port = None if metrics_port is None else metrics.serve_metrics(host, metrics_port)
        self.loop = EngineLoop(self.engine, admission_wait=admission_wait, on_step=self._observe_step)
        self.loop.start()

    def _observe_step(self, engine: LLMEngine) -> None:
        seqs, tokens = engine.last_batch
        if seqs:
            metrics.BATCH_SIZE.labels(self.model, self.name).observe(seqs)
            metrics.BATCH_TOKENS.labels(self.model, self.name).observe(tokens)

    def _serve(self, add_servicer: Callable[[grpc.Server], None], max_threads: int) -> None:
        host = self.host
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_threads,
                                                             thread_name_prefix=f"{self.kind}-grpc"))
        add_servicer(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # With a CA: mutual TLS, only a client with a certificate it signed (the router) gets in.
        self.port = security.add_port(self.server, f"{host}:0", self.tls,
                                      require_client_cert=self.tls is not None and self.tls.ca is not None)
        self.address = f"{host}:{self.port}"
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        register_self(self.info(), self.namespace)

    def info(self) -> dict:
        e = self.engine
        return {"name": self.name, "kind": self.kind, "address": self.address, "model": e.model_config.name,
                "max_model_len": e.max_model_len, "vocab_size": e.model_config.vocab_size,
                "block_size": e.pool.block_size, "node_id": ray.get_runtime_context().get_node_id(),
                "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                "nice": os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
                "metrics_address": f"{self.host}:{self.metrics_port}" if self.metrics_port is not None else None}

    def idle(self) -> bool:
        """No request in the engine and no handler running (subclasses add what else they hold)."""
        return self.engine.num_requests == 0 and self.service.active.value == 0

    def drain(self, timeout_s: float = 120.0, settle_s: float = 2.5) -> bool:
        """Stop taking new requests (health NOT_SERVING, which the router checks every second), let the
        ones in flight finish, then leave discovery. True if it became idle within ``timeout_s``."""
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        time.sleep(settle_s)  # requests routed before the router saw NOT_SERVING still arrive
        deadline = time.monotonic() + timeout_s
        while not self.idle() and time.monotonic() < deadline:
            time.sleep(0.1)
        unregister_self(self.name, self.namespace)
        return self.idle()

    def shutdown(self) -> None:
        unregister_self(self.name, self.namespace)
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=2).wait()
        self.loop.stop()
        self.tracing.shutdown()  # flushes the spans still queued

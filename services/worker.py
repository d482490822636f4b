"""What prefill and decode workers share: an engine on its own thread (EngineLoop), the worker base
(engine, gRPC server, health, registration, WorkerInfo), and the RPC wrapper (span, errors, abort)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import ray
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry.trace import SpanKind

from baton import metrics, security
from baton.api import InvalidRequestError, SamplingParams
from baton.api.proto import resolved_sampling, top_logprobs_to_proto
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine, RequestOutput
from baton.engine.speculative import SpecStats
from baton.grammar import CompiledGrammar, Grammars
from baton.kernels import cpu as cpu_kernels
from baton.memory import MemoryReport
from baton.model.lora import AdapterRef, LoraAdapter, LoraError
from baton.security import TLSConfig
from baton.services.cores import PREFILL_MIN_TOKENS, CoreBoard, CoreBorrower, CorePublisher
from baton.services.info import WorkerInfo
from baton.services.registry import register_self, unregister_self
from baton.tracing import Tracing, TracingConfig, extract, record_error, record_rpc_error
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

    def __init__(self, engine: LLMEngine, admission_wait: float,
                 on_step: Callable[[LLMEngine], None] | None = None,
                 before_step: Callable[[LLMEngine], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step  # called on the engine thread after each step (metrics)
        # called on the engine thread before each step, and while idle (cores.py)
        self.before_step = before_step
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
                if self.before_step is not None:  # idle: says so at once (and lends its cores)
                    self.before_step(self.engine)
                try:
                    cmd = self._commands.get(timeout=0.1)
                except queue.Empty:
                    continue
                cmd()
                if self.engine.has_unfinished():
                    self._drain(self.admission_wait)
            self._drain(0)
            self._dispatch(self.engine.emit_arrivals())
            if self.before_step is not None:
                self.before_step(self.engine)
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


def response_from_output(out: RequestOutput) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(request_id=out.request_id, token_ids=out.token_ids, text=out.text)
    if out.logprobs:
        resp.logprobs.extend(out.logprobs)
    if out.top_logprobs:
        resp.top_logprobs.extend(top_logprobs_to_proto(t) for t in out.top_logprobs)
    if out.finished:
        resp.finish_reason = out.finish_reason or ""
        resp.usage.CopyFrom(pb.Usage(prompt_tokens=out.prompt_tokens,
                                     cached_prompt_tokens=out.cached_prompt_tokens,
                                     completion_tokens=out.completion_tokens, spec_drafts=out.spec_drafts,
                                     spec_draft_tokens=out.spec_draft_tokens,
                                     spec_accepted_tokens=out.spec_accepted_tokens))
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


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker is started with (``baton.serve.Stack`` fills it from ServeConfig)."""

    name: str
    engine: EngineConfig
    host: str
    threads: int | None  # torch threads; None: torch's default
    admission_wait: float  # an idle engine waits this long to batch arrivals together
    namespace: str | None = None  # the stack's Ray namespace, where its registry and workers live
    tracing: TracingConfig | None = None  # where spans go; None: nowhere
    metrics_port: int | None = None  # serve Prometheus metrics there (0: any free port); None: off
    tls: TLSConfig | None = None
    cpus: tuple[int, ...] | None = None  # run every thread of the process on these cores
    # Pinned local stacks: the core board's file (cores.py); every worker publishes whether its cores are idle
    # and borrows idle ones among share_cpus (a prefill worker for long prompts, a decode worker for each step).
    core_board: str | None = None
    share_cpus: tuple[int, ...] | None = None


class Rpc:
    """One worker RPC's server span, error triage and abort, written once for every handler.

    ``with Rpc(tracing, name, context, attrs) as rpc:`` opens a SERVER span that joins the caller's
    trace; an exception ends it as an error (a client that left: cancelled). ``rpc.check(out)`` turns
    what an engine queue delivers instead of an output into the caller's status."""

    def __init__(self, tracing: Tracing, name: str, context: grpc.ServicerContext, attributes: dict) -> None:
        self.context = context
        self.tracer = tracing.tracer
        self.finished = False  # the handler delivered its answer; a cancel after that is no error
        self.span = tracing.tracer.start_span(
            name, kind=SpanKind.SERVER, attributes=attributes,
            context=extract(context.invocation_metadata()) if tracing.enabled else None)

    def __enter__(self) -> Rpc:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and not isinstance(exc, GeneratorExit):
            record_rpc_error(self.span, self.context, exc)
        elif not self.finished and not self.context.is_active():
            record_error(self.span, "the client cancelled", cancelled=True)
        self.span.end()

    def params(self, sampling: pb.SamplingParams) -> SamplingParams:
        """The params the router resolved; INVALID_ARGUMENT (naming the field) when they do not check."""
        try:
            return resolved_sampling(sampling)
        except InvalidRequestError as e:
            self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.detail("sampling."))

    def grammar(self, grammars: Grammars, params: SamplingParams, model: str, worker: str) -> CompiledGrammar | None:
        """The params' constraint compiled on this (gRPC) thread, not the engine's: cached by content,
        with its time and a span; INVALID_ARGUMENT naming the field when the compiler refuses it."""
        if params.constraint is None:
            return None
        try:
            return grammars.compile_observed(params.constraint, model, worker, self.tracer, self.span)
        except InvalidRequestError as e:
            self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.detail("sampling."))

    def invalid(self, e: InvalidRequestError) -> None:
        self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, e.detail())

    def adapter(self, engine: LLMEngine, wire) -> LoraAdapter | None:
        """The request's LoRA adapter (wire: a worker.proto Adapter), held or loaded now on this (gRPC) thread;
        None for the base model. FAILED_PRECONDITION when its folder no longer reads as the router's."""
        if not wire.name:
            return None
        self.span.set_attribute("baton.lora.adapter", wire.name)
        try:
            return engine.adapters.get(AdapterRef(wire.name, wire.path, wire.content_id))
        except LoraError as e:
            self.context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {wire.name!r}: {e}")

    def check(self, out: RequestOutput | BaseException, what: str) -> RequestOutput | None:
        """An engine queue's item: the output, None when the request was cancelled, else the status."""
        if isinstance(out, RequestCancelled):
            return None
        if isinstance(out, InvalidRequestError):
            self.invalid(out)
        if isinstance(out, BaseException):
            self.context.abort(grpc.StatusCode.INTERNAL, f"{what} failed: {out}")
        return out


class WorkerBase:
    """What a worker actor is made of: an engine on its loop thread, a gRPC server with health, and a
    registration that lets the router find it. Subclasses set ``kind`` and add their servicer."""

    kind = "worker"

    def __init__(self, spec: WorkerSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        if spec.cpus:
            pin_process(list(spec.cpus))  # threads started later inherit it
        if spec.threads:
            torch.set_num_threads(spec.threads)
        self.spec = spec
        self.name = name = spec.name
        self.host = spec.host
        self.tls = spec.tls
        self.namespace = spec.namespace
        self.tracing = Tracing(spec.tracing, self.kind, name)
        self.engine = LLMEngine(spec.engine)
        self.model = self.engine.model_config.name
        sched, pool = self.engine.scheduler, self.engine.pool
        speculator = self.engine.speculator
        metrics.start_series(self.model, name, self.kind, speculator.k if speculator else 0)
        self._spec_seen = SpecStats(accepted_per_pos=[0] * speculator.k) if speculator else None
        metrics.engine_gauges(self.model, name, lambda: len(sched.running), lambda: len(sched.waiting), pool.usage)
        adapters = self.engine.adapters
        metrics.LORA_ADAPTERS.labels(self.model, name).set_function(lambda: len(adapters.held()))

        def loaded(seconds: float) -> None:
            metrics.LORA_LOADS.labels(self.model, name).inc()
            metrics.LORA_LOAD_TIME.labels(self.model, name).observe(seconds)

        adapters.on_load = loaded
        self.engine.on_adapter_evict = metrics.LORA_EVICTIONS.labels(self.model, name).inc
        self._memory: tuple[float, MemoryReport] | None = None
        metrics.memory_gauges(self.model, name, lambda: self.memory().as_dict())
        logging.getLogger("baton").info("%s: weights %s (%s); %s%s", name, self.engine.weights_source,
                                        self.engine.model.weights.describe(), self.memory().summary(),
                                        f"; CPU kernels: {cpu_kernels.features()}" if self.engine.device.type == "cpu"
                                        else "")
        self.metrics_port = None if spec.metrics_port is None else metrics.serve_metrics(spec.host, spec.metrics_port)
        self.cores = self._core_sharing(self.kind, spec)
        if self.cores:  # a pass gives borrowed cores back between its layers once their owner has work
            self.engine.model.between_layers = self.cores.between_layers
        self.loop = EngineLoop(self.engine, admission_wait=spec.admission_wait, on_step=self._observe_step,
                               before_step=self.cores.before_step if self.cores else None)
        self.loop.start()
        self.engine.grammars.warm()

    def core_sharing(self) -> dict:
        """What this worker shares of its cores: whether they are marked idle, the cores it has borrowed now
        and the passes it ran on borrowed cores (empty when not sharing)."""
        return self.cores.state() if self.cores else {}

    @staticmethod
    def _core_sharing(kind: str, spec: WorkerSpec) -> CoreBorrower | None:
        """This worker's side of the core board (cores.py): it publishes whether its own cores are idle and
        borrows idle ones among share_cpus (a prefill worker for long prompts, a decode worker for every
        step); None when off."""
        if not (spec.core_board and spec.cpus):
            return None
        board = CoreBoard(spec.core_board)
        return CoreBorrower(board, list(spec.cpus), list(spec.share_cpus or ()), spec.threads or len(spec.cpus),
                            min_tokens=min(PREFILL_MIN_TOKENS, spec.engine.max_num_batched_tokens),
                            publisher=CorePublisher(board, list(spec.cpus)), per_step=kind == "decode")

    def _observe_step(self, engine: LLMEngine) -> None:
        if self.cores:  # a decode worker times the step the way it ran (on borrowed cores or not)
            self.cores.after_step()
        seqs, tokens = engine.last_batch
        if seqs:
            metrics.BATCH_SIZE.labels(self.model, self.name).observe(seqs)
            metrics.BATCH_TOKENS.labels(self.model, self.name).observe(tokens)
            masks = engine.last_masks
            if masks is not None:
                metrics.GRAMMAR_MASK.labels(self.model, self.name).observe(masks[0])
                metrics.GRAMMAR_MASK_WAIT.labels(self.model, self.name).observe(masks[1])
        spec = engine.speculator
        if spec is not None:  # the counts since the last step
            st, seen, m, w = spec.stats, self._spec_seen, self.model, self.name
            if st.num_drafts != seen.num_drafts:
                metrics.SPEC_DRAFTS.labels(m, w).inc(st.num_drafts - seen.num_drafts)
                metrics.SPEC_DRAFT_TOKENS.labels(m, w).inc(st.num_draft_tokens - seen.num_draft_tokens)
                metrics.SPEC_ACCEPTED_TOKENS.labels(m, w).inc(st.num_accepted_tokens - seen.num_accepted_tokens)
                for pos, (now, before) in enumerate(zip(st.accepted_per_pos, seen.accepted_per_pos, strict=True)):
                    if now != before:
                        metrics.SPEC_ACCEPTED_PER_POS.labels(m, w, str(pos)).inc(now - before)
                self._spec_seen = dataclasses.replace(st, accepted_per_pos=list(st.accepted_per_pos))

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

    def info(self) -> WorkerInfo:
        e = self.engine
        return WorkerInfo(
            name=self.name, kind=self.kind, address=self.address, model=e.model_config.name,
            max_model_len=e.max_model_len, vocab_size=e.model_config.vocab_size, block_size=e.pool.block_size,
            node_id=ray.get_runtime_context().get_node_id(),
            cpus=sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            nice=os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else None,
            metrics_address=f"{self.host}:{self.metrics_port}" if self.metrics_port is not None else None,
            model_config=e.model_config)

    def memory(self) -> MemoryReport:
        """This worker's memory by part, measured at most once a second (a scrape reads every part)."""
        now = time.monotonic()
        if self._memory is None or now - self._memory[0] > 1.0:
            self._memory = (now, self.engine.memory())
        return self._memory[1]

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
        if self.cores:
            self.cores.close()
        self.tracing.shutdown()  # flushes the spans still queued

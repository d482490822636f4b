"""Decode worker: continuous batching over its paged KV pool.

For each request it first reserves the blocks the prompt's KV needs (no room: RESOURCE_EXHAUSTED at
once, so memory pressure is backpressure), then pulls the KV from the prefill worker by calling that
worker's ``pull_kv`` actor method on a gRPC thread (never on the decode loop), writes it into the
reserved blocks and lets the sequence join the running batch at the next step. The pulled object
is owned by this process and dropped as soon as it has been copied into the pool.
"""

from __future__ import annotations

import logging
import time
from concurrent import futures

import grpc
import ray
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from baton.engine.engine import EngineConfig, LLMEngine, RequestOutput
from baton.engine.sampling import InvalidRequestError
from baton.services.prefill.worker import kv_from_numpy
from baton.services.registry import register_self, unregister_self
from baton.services.worker import EngineLoop, response_from_output, sampling_from_proto
from baton.v1 import worker_pb2 as wpb
from baton.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class DecodeService(wgrpc.DecodeWorkerServicer):
    def __init__(self, name: str, loop: EngineLoop, namespace: str | None, pull_timeout_s: float) -> None:
        self.name = name
        self.loop = loop
        self.namespace = namespace
        self.pull_timeout_s = pull_timeout_s
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self.kv_bytes_received = 0
        self.kv_seconds = 0.0
        self.handoffs = 0

    def _prefill_actor(self, name: str) -> ray.actor.ActorHandle:
        if name not in self._actors:
            self._actors[name] = ray.get_actor(name, namespace=self.namespace)
        return self._actors[name]

    def Decode(self, request: wpb.DecodeRequest, context: grpc.ServicerContext):
        try:
            params = sampling_from_proto(request.sampling)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        engine = self.loop.engine
        blocks = self.loop.call(lambda: engine.reserve_blocks(len(prompt)))
        if blocks is None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"decode worker {self.name} has no free KV blocks for {len(prompt)} tokens")
        owned = True
        try:
            t0 = time.perf_counter()
            timeout = self.pull_timeout_s
            remaining = context.time_remaining()
            if remaining is not None and remaining < timeout:
                timeout = max(0.1, remaining)
            try:
                obj = ray.get(self._prefill_actor(request.prefill_worker).pull_kv.remote(rid), timeout=timeout)
            except Exception as e:  # noqa: BLE001 - any failed hand-off is reported the same way
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"KV hand-off from prefill worker {request.prefill_worker} failed: {e}")
            kv = kv_from_numpy(obj)
            nbytes = obj["kv"].nbytes
            self.kv_seconds += time.perf_counter() - t0
            self.kv_bytes_received += nbytes
            self.handoffs += 1
            if not context.is_active():
                return
            first_lp = request.first_logprob if request.HasField("first_logprob") else None
            q = self.loop.add(rid, lambda: engine.add_prefilled(
                prompt, request.first_token, params, blocks, kv, request_id=rid,
                sampler_state=request.sampler_state, cached_prompt_tokens=request.cached_prompt_tokens,
                first_logprob=first_lp))
            owned = False  # the blocks now belong to the request; abort frees them
            obj = kv = None  # drop the pulled object now, not when the stream ends
        finally:
            if owned:
                self.loop.call(lambda: engine.release_blocks(blocks))
        context.add_callback(lambda: self.loop.abort(rid))
        while True:
            out = q.get()
            if isinstance(out, BaseException):
                context.abort(grpc.StatusCode.INTERNAL, f"decode failed: {out}")
            assert isinstance(out, RequestOutput)
            yield response_from_output(out)
            if out.finished:
                return


class DecodeWorker:
    """A Ray actor (wrapped with ray.remote by the launcher): an engine, a gRPC server."""

    def __init__(self, name: str, config: EngineConfig, host: str = "127.0.0.1", threads: int | None = None,
                 admission_wait: float = 0.015, pull_timeout_s: float = 30.0) -> None:
        logging.basicConfig(level=logging.INFO)
        if threads:
            torch.set_num_threads(threads)
        self.name = name
        self.engine = LLMEngine(config)
        self.loop = EngineLoop(self.engine, admission_wait=admission_wait)
        self.loop.start()
        namespace = ray.get_runtime_context().namespace
        self.service = DecodeService(name, self.loop, namespace, pull_timeout_s)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=256, thread_name_prefix="decode-grpc"))
        wgrpc.add_DecodeWorkerServicer_to_server(self.service, self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:0")
        self.address = f"{host}:{self.port}"
        self.server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        register_self(self.info())

    def info(self) -> dict:
        e = self.engine
        return {"name": self.name, "kind": "decode", "address": self.address, "model": e.model_config.name,
                "max_model_len": e.max_model_len, "vocab_size": e.model_config.vocab_size}

    def stats(self) -> dict:
        pool = self.engine.pool
        s = self.service
        return {"free_blocks": pool.num_free_blocks, "num_blocks": pool.num_blocks,
                "requests": self.engine.num_requests, "handoffs": s.handoffs,
                "kv_bytes_received": s.kv_bytes_received, "kv_seconds": s.kv_seconds}

    def shutdown(self) -> None:
        unregister_self(self.name)
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=2).wait()
        self.loop.stop()


__all__ = ["DecodeWorker"]

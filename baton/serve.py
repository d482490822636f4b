"""``baton serve``: the disaggregated stack on Ray (prefill workers, decode workers, the router)."""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from dataclasses import dataclass

import ray

from baton.engine.engine import EngineConfig
from baton.loader import load_tokenizer
from baton.services.decode.worker import DecodeWorker
from baton.services.prefill.worker import PrefillWorker
from baton.services.registry import REGISTRY_NAME, Registry
from baton.services.router.router import ModelInfo, Router

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig = EngineConfig()
    prefill: int = 1
    decode: int = 1
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    address: str | None = None  # an existing Ray cluster (else RAY_ADDRESS, else a local instance)
    threads_per_worker: int | None = None  # default: the machine's cores shared among the workers
    admission_wait: float = 0.015
    max_in_flight: int = 256
    object_store_memory: int | None = 512 << 20  # for a local Ray instance

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("at least one prefill and one decode worker are needed")


class Stack:
    """Starts Ray (or joins it), the workers as Ray actors and the router; ``stop`` tears it all down."""

    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.namespace = f"baton-{uuid.uuid4().hex[:8]}"
        self.prefill: list = []
        self.decode: list = []
        self.router: Router | None = None
        self.registry = None
        self._owns_ray = False

    def start(self) -> Stack:
        c = self.config
        if not ray.is_initialized():
            address = c.address or os.environ.get("RAY_ADDRESS")
            kwargs = {} if address else {"object_store_memory": c.object_store_memory, "include_dashboard": False}
            ray.init(address=address, namespace=self.namespace, log_to_driver=False, **kwargs)
            self._owns_ray = True
        workers = c.prefill + c.decode
        threads = c.threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        opts = {"namespace": self.namespace, "num_cpus": 0, "max_concurrency": 32}
        self.registry = ray.remote(Registry).options(name=REGISTRY_NAME, namespace=self.namespace,
                                                     num_cpus=0).remote()
        prefill_cls, decode_cls = ray.remote(PrefillWorker), ray.remote(DecodeWorker)
        self.prefill = [prefill_cls.options(name=f"prefill-{i}", **opts).remote(
            f"prefill-{i}", c.engine, c.host, threads) for i in range(c.prefill)]
        self.decode = [decode_cls.options(name=f"decode-{i}", **opts).remote(
            f"decode-{i}", c.engine, c.host, threads, c.admission_wait) for i in range(c.decode)]
        infos = ray.get([a.info.remote() for a in self.prefill + self.decode])
        first = infos[0]
        model = ModelInfo(first["model"], first["max_model_len"], first["vocab_size"])
        registry = self.registry
        self.router = Router(load_tokenizer(c.engine.model), model, c.host, c.port, c.max_in_flight,
                             discover=lambda: ray.get(registry.workers.remote(), timeout=5))
        self.router.refresh()  # the workers registered themselves while starting
        self.router.start()
        return self

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.address

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for actor in self.prefill + self.decode:
            with contextlib.suppress(Exception):  # a dead worker needs no shutdown
                ray.get(actor.shutdown.remote(), timeout=10)
            ray.kill(actor)
        self.prefill, self.decode = [], []
        with contextlib.suppress(Exception):
            ray.kill(self.registry)
        if self._owns_ray:
            ray.shutdown()

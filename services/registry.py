"""Worker discovery: a named Ray actor where workers register their gRPC address and the router reads.

Workers register when they start and unregister when they shut down; the router polls ``workers()``
and also drops a worker whose health checks keep failing (a crashed worker cannot unregister). The stack's
launcher also leaves here what another router needs to serve the stack (``router_spec``): `baton router`
replicas read it.
"""

from __future__ import annotations

import contextlib

import ray

from baton.services.info import WorkerInfo

REGISTRY_NAME = "baton-registry"


class Registry:
    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}
        self._router_spec = None  # what another router needs to serve this stack (baton.serve.RouterSpec)

    def set_router_spec(self, spec) -> None:
        self._router_spec = spec

    def router_spec(self):
        return self._router_spec

    def register(self, info: WorkerInfo) -> None:
        self._workers[info.name] = info

    def unregister(self, name: str) -> bool:
        return self._workers.pop(name, None) is not None

    def workers(self) -> list[WorkerInfo]:
        return list(self._workers.values())


def register_self(info: WorkerInfo, namespace: str | None = None) -> None:
    """Called by a worker (inside its actor) once its gRPC server is up. ``namespace``: the stack's Ray
    namespace (several stacks may share one Ray instance); None means the job's."""
    ray.get(ray.get_actor(REGISTRY_NAME, namespace=namespace).register.remote(info))


def unregister_self(name: str, namespace: str | None = None) -> None:
    with contextlib.suppress(Exception):  # the registry may be gone at shutdown
        ray.get(ray.get_actor(REGISTRY_NAME, namespace=namespace).unregister.remote(name), timeout=5)

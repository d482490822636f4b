"""The router's LoRA adapters: name -> folder and content id, and which workers hold which adapter.

Adapters come from ``--lora NAME=PATH`` at start and from the LoadAdapter / UnloadAdapter RPCs (only for
folders under ``--lora-root``: without it, loading at run time is refused). Each is read and checked here
against the model's shapes (baton/api/adapters.py, no torch) before it is listed, so a bad folder is a
clear error and never reaches a worker.
A request carries the adapter's name, folder and content id to its workers, which load it on first use
(baton/model/lora.py) and refuse it if the folder changed since.

Which worker holds what: a prefill worker reports the adapters it holds with each response; for decode
workers the router remembers what it sent where (each worker keeps its ``max_loras`` most recent). Routing
prefers a holder among workers of equal cost (``prefers``).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from baton.api.adapters import AdapterRef, LoraError, read_adapter
from baton.config import ModelConfig

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,63}")
MAX_ADAPTERS = 256  # listed at once


class AdapterNotFound(LookupError):
    pass


class AdapterRefused(ValueError):
    """A load the router does not allow (FAILED_PRECONDITION) as opposed to a bad adapter (LoraError)."""


@dataclass(frozen=True)
class Listed:
    ref: AdapterRef
    rank: int
    targets: frozenset[str]
    loaded_at: float


class AdapterTable:
    def __init__(self, config: ModelConfig | None, base_name: str, max_rank: int, root: str | None = None,
                 max_loras: int = 4) -> None:
        self.config, self.base_name, self.max_rank, self.max_loras = config, base_name, max_rank, max_loras
        self.root = os.path.realpath(root) if root else None
        self._lock = threading.Lock()
        self._by_name: dict[str, Listed] = {}
        # worker name -> content ids it holds, most recent last (prefill: as reported; decode: as sent)
        self._held: dict[str, OrderedDict[str, None]] = {}

    def check_name(self, name: str) -> None:
        if not NAME.fullmatch(name):
            raise LoraError("adapter names are 1-64 characters: letters, digits and . _ - : / (not first)")
        if name == self.base_name:
            raise LoraError(f"{name!r} is the base model's name")

    def add(self, name: str, path: str, at_start: bool = False) -> Listed:
        """Read and check the folder, then list it under ``name`` (a new load of a listed name replaces it:
        new content, new id, no KV of the old one reused). LoraError names what to fix."""
        self.check_name(name)
        if self.config is None:
            raise AdapterRefused("this router does not know the model's shapes; adapters cannot be checked")
        if not at_start:
            if self.root is None:
                raise AdapterRefused("loading adapters at run time is off; start the server with --lora-root DIR "
                                     "and load folders under DIR")
            real = os.path.realpath(path)
            if os.path.commonpath([real, self.root]) != self.root:
                raise AdapterRefused(f"adapter folders must lie under {self.root} (--lora-root)")
        with self._lock:
            if name not in self._by_name and len(self._by_name) >= MAX_ADAPTERS:
                raise AdapterRefused(f"{MAX_ADAPTERS} adapters are listed already; unload one first")
        spec = read_adapter(name, path, self.config, self.max_rank)
        listed = Listed(spec.ref, spec.rank, spec.targets, time.time())
        with self._lock:
            self._by_name[name] = listed
        return listed

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def resolve(self, name: str) -> AdapterRef | None:
        """The adapter a request names (None for the base model); AdapterNotFound when unlisted."""
        if not name or name == self.base_name:
            return None
        with self._lock:
            listed = self._by_name.get(name)
        if listed is None:
            raise AdapterNotFound(f"adapter {name[:64]!r} is not loaded; ListModels lists the adapters")
        return listed.ref

    def listed(self) -> list[Listed]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda a: a.ref.name)

    # -- who holds what

    def reported(self, worker: str, content_ids) -> None:
        with self._lock:
            self._held[worker] = OrderedDict.fromkeys(content_ids)

    def sent(self, worker: str, ref: AdapterRef) -> None:
        with self._lock:
            held = self._held.setdefault(worker, OrderedDict())
            held[ref.content_id] = None
            held.move_to_end(ref.content_id)
            while len(held) > self.max_loras:
                held.popitem(last=False)

    def holds(self, worker: str, ref: AdapterRef) -> bool:
        with self._lock:
            return ref.content_id in self._held.get(worker, ())

    def prefers(self, workers: list, ref: AdapterRef | None, load) -> list:
        """Workers reordered so that, among those with the lowest ``load``, holders of ``ref`` come first."""
        if ref is None or len(workers) < 2:
            return workers
        best = min(load(w) for w in workers)
        return sorted(workers, key=lambda w: (load(w) > best, not self.holds(w.name, ref)))

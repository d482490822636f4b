"""Memory a worker holds, accounted by part, and the allocations that keep it low.

- ``zeroed(nbytes)``: a zero-filled buffer whose pages become resident only when first written (an anonymous
  mapping). The KV pool lives in one: a 1 GiB pool costs what its used blocks hold, not 1 GiB at start.
- ``resident_bytes(tensors)``: how many bytes of these tensors' pages are in memory now (``mincore``).
- ``release_free_memory()``: hands the C heap's free pages back to the system (after loading, whose
  temporaries the allocator would otherwise keep).
- ``MemoryReport``: one process's breakdown (weights, KV pool, the rest), for ``baton serve --verbose``,
  a worker's ``info`` and the ``baton_memory_bytes`` gauges.

Resident set (RSS) counts a shared page in every process that maps it; the proportional set (PSS) divides
it among them, so the sum of PSS over a stack's processes is what the stack holds. Both are reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
from dataclasses import asdict, dataclass

import torch

__all__ = ["MemoryReport", "process_tree_memory", "release_free_memory", "resident_bytes", "zeroed"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_PAGE = mmap.PAGESIZE


def zeroed(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` zeros on an anonymous mapping: resident only as it is written."""
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _resident(address: int, length: int) -> int:
    start = address - address % _PAGE
    pages = -(-(address + length - start) // _PAGE)
    vec = (ctypes.c_ubyte * pages)()
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * _PAGE), vec) != 0:
        return 0
    return sum(b & 1 for b in bytes(vec)) * _PAGE


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of these CPU tensors' pages in memory now (a page shared by two tensors counted once per tensor)."""
    total = 0
    for t in tensors:
        if t.device.type == "cpu" and t.numel():
            total += min(_resident(t.data_ptr(), t.numel() * t.element_size()), t.numel() * t.element_size())
    return total


def release_free_memory() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; a no-op elsewhere)."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def _mappings() -> list[tuple[int, int, bool, int]]:
    """This process's mappings from /proc/self/smaps: (start, end, file-backed, resident bytes)."""
    maps: list[tuple[int, int, bool, int]] = []
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    lo, _, hi = head[0].partition("-")
                    maps.append((int(lo, 16), int(hi, 16), head[4] != "0", 0))
                elif head[0] == "Rss:" and maps:
                    lo, hi, file, _ = maps[-1]
                    maps[-1] = (lo, hi, file, int(head[1]) * 1024)
    except (OSError, ValueError, IndexError):
        return []
    return maps


def _weights_memory(tensors: list[torch.Tensor]) -> tuple[bool, int]:
    """Whether every tensor lies in a file mapping (a weight image), and the bytes of these tensors resident
    in this process: the mappings' resident sets when mapped, else the tensors' resident pages."""
    live = [t for t in tensors if t.numel() and t.device.type == "cpu"]
    maps = _mappings()
    holding = {m for t in live for m in maps if m[0] <= t.data_ptr() < m[1]}
    if holding and all(file for _, _, file, _ in holding):
        return True, sum(rss for _, _, _, rss in holding)
    return False, resident_bytes(live)


def process_tree_memory(pid: int) -> dict[str, int]:
    """A process and every process below it: how many, and their resident and proportional sets summed (a
    process that ends meanwhile counts as one, with nothing)."""
    import psutil

    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    rss = pss = 0
    for proc in tree:
        with contextlib.suppress(psutil.Error):
            info = proc.memory_full_info()
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
    return {"processes": len(tree), "rss": rss, "pss": pss}


@dataclass(frozen=True)
class MemoryReport:
    """One process's memory, in bytes. ``weights``: the prepared weights (``weights_shared``: mapped from a
    weight image that other workers on the node map too, else 0); ``kv_pool``: reserved for the KV blocks,
    ``kv_resident`` of it in memory; ``rss``, ``pss``, ``uss``: the process's resident, proportional and
    unique set; ``runtime``: the resident set less the weights' and the KV pool's resident pages (Python,
    torch, Ray's core worker, gRPC, activations and buffers)."""

    weights: int
    weights_shared: int
    kv_pool: int
    kv_resident: int
    rss: int
    pss: int
    uss: int
    runtime: int

    @classmethod
    def measure(cls, weights: list[torch.Tensor], kv: list[torch.Tensor]) -> MemoryReport:
        import psutil

        weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        mapped, weights_resident = _weights_memory(weights)
        kv_pool = sum(t.numel() * t.element_size() for t in kv)
        kv_resident = resident_bytes(kv)
        info = psutil.Process(os.getpid()).memory_full_info()
        runtime = max(0, info.rss - weights_resident - kv_resident)
        shared = weight_bytes if mapped else 0
        return cls(weight_bytes, shared, kv_pool, kv_resident, info.rss, getattr(info, "pss", info.rss), info.uss,
                   runtime)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def summary(self) -> str:
        mib = 2**20
        where = "shared (a weight image)" if self.weights_shared else "private"
        return (f"weights {self.weights / mib:.0f} MiB {where}; KV pool {self.kv_resident / mib:.0f} of "
                f"{self.kv_pool / mib:.0f} MiB resident; runtime {self.runtime / mib:.0f} MiB; "
                f"RSS {self.rss / mib:.0f} MiB, PSS {self.pss / mib:.0f} MiB, unique {self.uss / mib:.0f} MiB")

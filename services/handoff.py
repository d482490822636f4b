"""The KV hand-off codec: what a prefill worker's ``pull_kv`` returns and a decode worker writes into its
pool. NumPy arrays, so the object store hands them over zero-copy; NumPy has no bfloat16, so bfloat16
moves as int16 bits. Both sides import this module and nothing else of each other."""

from __future__ import annotations

import warnings

import torch

from baton.engine.model_runner import KVSnapshot


def kv_to_numpy(kv: KVSnapshot) -> dict:
    """The hand-off object: {"kv": ndarray, "dtype": str[, "scales": ndarray]}."""
    values = kv.values.contiguous()
    dtype = str(values.dtype).removeprefix("torch.")
    arr = values.view(torch.int16).numpy() if values.dtype == torch.bfloat16 else values.numpy()
    out = {"kv": arr, "dtype": dtype}
    if kv.scales is not None:
        out["scales"] = kv.scales.contiguous().numpy()
    return out


def kv_from_numpy(obj: dict) -> KVSnapshot:
    def tensor(arr):
        # Arrays from the object store are read-only and zero-copy; the engine only reads them (it copies
        # into its pool), so torch's warning about non-writable arrays does not apply.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(arr)

    values = tensor(obj["kv"])
    if obj["dtype"] == "bfloat16":
        values = values.view(torch.bfloat16)
    return KVSnapshot(values, tensor(obj["scales"]) if "scales" in obj else None)


def kv_nbytes(obj: dict) -> int:
    return obj["kv"].nbytes + (obj["scales"].nbytes if "scales" in obj else 0)

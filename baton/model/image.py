"""Weight images: a model's weights in the layout its kernels read (``ModelWeights``), in one file that every
worker on a node maps, so that N workers on a node hold one copy of the weights and the model file is parsed
and packed once per node instead of once per worker.

The first worker to need an image builds it (under a lock on the folder, so the others wait for it rather
than build their own), writes it to a temporary name and renames it; every worker, the builder included,
then maps it copy-on-write (``MAP_PRIVATE``): the pages are the page cache's, shared by every process that
maps the file, and a write to a weight (none is made) would copy that page into the writer alone.

An image's name is a hash of what its bytes depend on: the model file (path, size, modification time), the
dtype, the weight mode, the CPU kernels available and the source of the code that loads and packs (and of the
config and tokenizer it keeps). A change to any of them makes a new image; a stale one is never read.

Layout: a header (magic, format, sizes), a pickle of the ``ModelWeights`` object graph in which each tensor
is a reference (offset, dtype, shape) into the data section, and the data section (page-aligned, each tensor
64-byte aligned). The pickle is read with an unpickler that builds only the model's own weight classes. The
folder must belong to the user and be writable by no one else (it is created so).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import mmap
import os
import pickle
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from baton.config import ConfigError
from baton.model.linear import Linear
from baton.model.llama import LayerWeights, ModelWeights

__all__ = ["FORMAT", "image_key", "map_image", "shared_weights", "write_image"]

MAGIC = b"BATONIMG"
FORMAT = 1
_HEADER = struct.Struct("<8sIIQQQ")  # magic, format, reserved, pickle bytes, data offset, data bytes
_ALIGN = 64
_PAGE = mmap.PAGESIZE
# The classes an image's pickle may build (and nothing else: no callable reaches the unpickler).
_CLASSES = {("baton.model.llama", "ModelWeights"): ModelWeights, ("baton.model.llama", "LayerWeights"): LayerWeights,
            ("baton.model.linear", "Linear"): Linear}
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16,
                               torch.int32, torch.int64)}
# The code whose changes change an image's bytes: loading, dequantizing, packing, and the model's config and
# tokenizer that it keeps beside the weights.
_SOURCES = ("model", "loader", "kernels", "config.py", "tokenizer.py")


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def _model_identity(model_path: str) -> list[str]:
    path = os.path.realpath(model_path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, name) for name in os.listdir(path) if os.path.isfile(os.path.join(path, name)))
    ids = [path]
    for f in files:
        st = os.stat(f)
        ids.append(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}")
    return ids


def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for source in _SOURCES:
        files = sorted((root / source).glob("*")) if (root / source).is_dir() else [root / source]
        for f in files:
            if f.suffix in (".py", ".c"):
                h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def image_key(model_path: str, dtype: torch.dtype, weight_mode: str, kernel_features: tuple) -> str:
    """The name of the image for this model file and preparation (a hash: any change gives a new image)."""
    parts = [f"format={FORMAT}", f"torch={torch.__version__}", f"dtype={dtype}", f"weights={weight_mode}",
             f"kernels={kernel_features}", f"source={_source_digest()}", *_model_identity(model_path)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


class _Writer(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=5)
        self.tensors: list[torch.Tensor] = []
        self.refs: dict[int, tuple] = {}
        self.size = 0

    def persistent_id(self, obj: object) -> tuple | None:
        if not isinstance(obj, torch.Tensor):
            return None
        ref = self.refs.get(id(obj))
        if ref is None:
            if obj.device.type != "cpu":
                raise ValueError("a weight image holds CPU tensors only")
            if str(obj.dtype) not in _DTYPES:
                raise ValueError(f"a weight image cannot hold {obj.dtype} tensors")
            offset = _align(self.size, _ALIGN)
            ref = ("tensor", offset, str(obj.dtype), tuple(obj.shape))
            self.size = offset + obj.numel() * obj.element_size()
            self.refs[id(obj)] = ref
            self.tensors.append(obj)
        return ref


def write_image(path: str, weights: ModelWeights, model: dict | None = None) -> None:
    """Write ``weights`` as an image at ``path`` (a new file; callers rename it into place), with ``model``: plain
    values (dicts, lists, strings, numbers) that describe the model beside them, such as its config and tokenizer,
    so that a worker that maps the image need not parse the model file at all."""
    graph = io.BytesIO()
    writer = _Writer(graph)
    writer.dump({"weights": weights, "model": model})
    blob = graph.getvalue()
    data_offset = _align(_HEADER.size + len(blob), _PAGE)
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(_HEADER.pack(MAGIC, FORMAT, 0, len(blob), data_offset, writer.size))
        f.write(blob)
        for t in writer.tensors:
            ref = writer.refs[id(t)]
            f.seek(data_offset + ref[1])
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.truncate(data_offset + writer.size)


class _Reader(pickle.Unpickler):
    def __init__(self, blob: bytes, mapped: mmap.mmap, data_offset: int) -> None:
        super().__init__(io.BytesIO(blob))
        self.mapped = mapped
        self.data_offset = data_offset

    def find_class(self, module: str, name: str) -> type:
        cls = _CLASSES.get((module, name))
        if cls is None:
            raise pickle.UnpicklingError(f"a weight image may not refer to {module}.{name}")
        return cls

    def persistent_load(self, pid: tuple) -> torch.Tensor:
        kind, offset, dtype_name, shape = pid
        dtype = _DTYPES.get(dtype_name)
        if kind != "tensor" or dtype is None:
            raise pickle.UnpicklingError(f"a weight image holds an unknown reference {pid!r}")
        numel = 1
        for n in shape:
            numel *= n
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self.mapped, dtype=dtype, count=numel, offset=self.data_offset + offset).view(shape)


def map_image(path: str) -> tuple[ModelWeights, dict | None]:
    """The ``ModelWeights`` of an image, every tensor a view of the file mapped copy-on-write, and the model's
    description written with them."""
    with open(path, "rb") as f:
        head = f.read(_HEADER.size)
        if len(head) < _HEADER.size:
            raise ValueError(f"{path}: not a weight image (too short)")
        magic, fmt, _, blob_len, data_offset, data_len = _HEADER.unpack(head)
        if magic != MAGIC or fmt != FORMAT:
            raise ValueError(f"{path}: not a weight image of format {FORMAT}")
        size = os.fstat(f.fileno()).st_size
        if size != data_offset + data_len:
            raise ValueError(f"{path}: {size} bytes, the header says {data_offset + data_len}")
        blob = f.read(blob_len)
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    graph = _Reader(blob, mapped, data_offset).load()
    if not isinstance(graph, dict) or not isinstance(graph.get("weights"), ModelWeights):
        raise ValueError(f"{path}: holds no model weights")
    return graph["weights"], graph.get("model")


def check_folder(folder: str) -> None:
    """Create ``folder`` (0700) or check that it is the user's own and writable by no one else: an image is
    read back as the model's weights, so no other user may place one there."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.stat(folder)
    except OSError as e:
        raise ConfigError(f"shared weights folder {folder}: {e.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"shared weights folder {folder} is not a folder")
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise ConfigError(f"shared weights folder {folder} must be owned by this user and writable by no one "
                          f"else (it is owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")


def shared_weights(folder: str, key: str, build: Callable[[], tuple[ModelWeights, dict | None]]
                   ) -> tuple[ModelWeights, dict | None, bool]:
    """The weights of image ``key`` in ``folder``, mapped, and the model description stored with them; ``build()``
    makes both (once per folder: the other callers wait on the folder's lock and map what it wrote). Returns
    (weights, model, whether this call built them)."""
    check_folder(folder)
    path = os.path.join(folder, f"weights-{key}.img")
    fd = os.open(os.path.join(folder, f"weights-{key}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError, ValueError):  # missing, or cut short: build it again
            return *map_image(path), False
        weights, model = build()
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            write_image(tmp, weights, model)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        del weights  # the private copy: every caller, this one too, reads the shared mapping
        return *map_image(path), True
    finally:
        os.close(fd)

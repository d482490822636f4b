"""C kernels for CPU (cpu_kernels.c), built at first use, with their torch references.

Matmuls on weights packed at load time (bfloat16 for every pass; q4_1 and q8_0 blocks for small
passes), paged attention (decode rows alone or with the rotary embedding and the K/V write, and
prefill chunks), residual add + RMSNorm, SiLU-mul, the row argmax, the structured-output mask, and
``decode_layers``, which runs every layer of a decode-only pass in one call.

The C file is compiled once per machine with the system C compiler (``cc``, or ``$CC``) and
``-O3 -march=native -fopenmp`` (a second build, with ``-fopenmp-simd``, serves calls on one
thread) into a cache folder (``$BATON_CACHE_DIR``, else ``~/.cache/baton``), each build named
by a hash of the source, the flags and the CPU, so nodes of
different kinds sharing a home folder never load each other's build. Without a compiler
:func:`library` raises :class:`KernelBuildError` with the reason: the CPU attention backend
gives way to the torch one, and ``--weights q4`` is refused.

Weight schemes (blocks of 32 along the input dimension, as in GGUF):

* ``q4_1``: ``w = d * q + m`` with ``q`` in 0..15; stored as ``qs`` uint8 [N, K/2] (byte j of a
  block: weight j in the low nibble, weight j + 16 in the high one), ``d`` and ``m`` float32 [N, K/32].
* ``q8_0``: ``w = d * q`` with ``q`` in -127..127; stored as ``q`` int8 [N, K], ``d`` float32 [N, K/32].

Quantizing weights that came from a GGUF file in the same scheme gives back their stored values
(the extremes of each block sit exactly on the grid). Activations are quantized per row to int8
in blocks of 32 inside the kernel; :func:`reference_gemm` is the same arithmetic in torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.kernels.paged_attention import Chunks

QK = 32
SOURCE = Path(__file__).with_name("cpu_kernels.c")
# -fno-math-errno lets expf vectorize (glibc's vector math); nothing here reads errno.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
# Calls on one thread (every worker of the default layout) take a second build without OpenMP:
# a parallel region whose `if` is false still goes through libgomp's team setup, about 1 us, a few
# hundred times a decode step (1.04x on a 1-sequence Q8_0 step on a 2-core AVX2 EPYC, 1.0x at 16).
# -fopenmp-simd keeps the `omp simd` loops vectorized; the results are the same bits.
SERIAL_FLAGS = [f if f != "-fopenmp" else "-fopenmp-simd" for f in FLAGS]


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be built or loaded here (no compiler, compile error)."""


_lock = threading.Lock()
_libs: dict[bool, ctypes.CDLL] = {}  # by serial (one thread)
_errors: dict[bool, str] = {}
_amx_on = 1  # set_amx's choice, given to every build loaded


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def cache_dir() -> Path:
    root = os.environ.get("BATON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "baton")
    return Path(root) / "kernels"


def _compiler() -> str:
    env = os.environ.get("CC")
    if env:
        cc = shutil.which(env)
        if not cc:
            raise KernelBuildError(f"the CPU kernels need a C compiler: $CC is {env!r}, which is not an executable")
        return cc
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise KernelBuildError("the CPU kernels need a C compiler (cc, gcc or clang, or $CC); "
                               "install one (Debian: apt-get install -y gcc) or use --weights auto")
    return cc


def build(serial: bool = False) -> Path:
    """Compile cpu_kernels.c (with OpenMP, or without it for calls on one thread) unless a build for this
    source, compiler, flags and CPU is cached."""
    cc = _compiler()
    flags = SERIAL_FLAGS if serial else FLAGS
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), cc.encode(), " ".join(flags).encode(),
                                     _cpu_id().encode()])).hexdigest()[:16]
    out = cache_dir() / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Several workers may build at once: each writes its own file, then renames it into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise KernelBuildError(f"compiling {SOURCE.name} with {cc} failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _load(serial: bool) -> None:
    """Builds and loads one of the two builds into _libs, or records why it failed in _errors (under _lock)."""
    try:
        lib = ctypes.CDLL(str(build(serial)))
    except KernelBuildError as e:
        _errors[serial] = str(e)
    except OSError as e:
        _errors[serial] = f"loading the CPU kernels failed: {e}"
    else:
        p, i = ctypes.c_void_p, ctypes.c_int
        lib.baton_gemm_q4_1.argtypes = [p, i, i, p, p, i, p, i]
        lib.baton_gemm_q8_0.argtypes = [p, i, i, p, p, p, i, p, i]
        lib.baton_gemm_gq.argtypes = [p, i, i, p, p, p, i, p, i]
        lib.baton_gq_rows.argtypes = [p, p, i, p, i, p, i]
        lib.baton_quantize_rows.argtypes = [p, i, i, p, p, p]
        lib.baton_gemm_bf16.argtypes = [p, i, i, p, p, i, p, i]
        lib.baton_gemm_bf16_f32.argtypes = [p, i, i, p, p, i, p, i]
        lib.baton_argmax_rows.argtypes = [p, i, i, p, i]
        lib.baton_mask_rows.argtypes = [p, i, p, i, p, i]
        lib.baton_read_bytes.argtypes = [p, p, i, i]
        lib.baton_read_bytes.restype = ctypes.c_int64
        lib.baton_add_rms_norm.argtypes = [p, p, p, p, i, i, ctypes.c_float, i, i]
        lib.baton_decode_attention.argtypes = [p, i, i, i, i, i, p, p, p, p, p, i, i, p, p, i, p,
                                               ctypes.c_float, i, p, i]
        lib.baton_silu_mul.argtypes = [p, p, i, i, i, i]
        lib.baton_decode_layers.argtypes = [p, i, p, i, i, i, i, i, i, i, ctypes.c_float, p, p, p, i, i,
                                            p, p, i, p, ctypes.c_float, p, i, i]
        lib.baton_paged_decode.argtypes = [p, i, i, i, i, p, p, i, i, i, p, i, p, ctypes.c_float, i, p, i]
        lib.baton_has_prefill_attention.argtypes = [i, i]
        lib.baton_prefill_attention.argtypes = [p, i, i, i, p, p, i, p, p, i, i, i, p, p, p, p, i,
                                                ctypes.c_float, i, p, i]
        lib.baton_set_amx.argtypes = [i]
        for f in (lib.baton_gemm_q4_1, lib.baton_gemm_q8_0, lib.baton_gemm_bf16, lib.baton_paged_decode,
                  lib.baton_has_bf16_gemm, lib.baton_add_rms_norm, lib.baton_decode_attention,
                  lib.baton_silu_mul, lib.baton_decode_layers, lib.baton_has_prefill_attention,
                  lib.baton_prefill_attention, lib.baton_amx, lib.baton_set_amx, lib.baton_openmp):
            f.restype = i
        lib.baton_set_amx(_amx_on)
        _libs[serial] = lib


def library() -> ctypes.CDLL:
    """The loaded kernels for this thread count (built on first call; one build for one thread, one for
    more); raises KernelBuildError if neither build can be made. Where only one can (a compiler without
    an OpenMP runtime), it serves every thread count: the same results, on one thread."""
    serial = torch.get_num_threads() == 1
    lib = _libs.get(serial)
    if lib is not None:  # the fast path of every kernel call: no lock once loaded
        return lib
    with _lock:
        for which in (serial, not serial):
            if which not in _libs and which not in _errors:
                _load(which)
            if which in _libs:
                _libs[serial] = _libs[which]
                return _libs[serial]
        raise KernelBuildError(_errors[serial])


def available() -> bool:
    try:
        library()
    except KernelBuildError:
        return False
    return True


# ---------------------------------------------------------------- weights


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"block quantization needs an input dimension divisible by {QK}, got {k}")
    return weight.detach().float().reshape(n, k // QK, QK)


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (qs uint8 [N, K/2], d float32 [N, K/32], m float32 [N, K/32])."""
    w = _blocks(weight)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    qs = q[..., : QK // 2] | (q[..., QK // 2:] << 4)
    return qs.reshape(w.shape[0], -1).contiguous(), d.contiguous(), lo.contiguous()


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q int8 [N, K], d float32 [N, K/32])."""
    w = _blocks(weight)
    d = w.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(w.shape[0], -1).contiguous(), d.contiguous()


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    b = qs.reshape(n, -1, QK // 2)
    q = torch.cat([b & 0x0F, b >> 4], dim=2).float()
    return (q * d[..., None] + m[..., None]).reshape(n, -1)


Q4_TILE_ROWS = 16  # output rows per tile of the packed q4_1 layout


def pack_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """quantize_q4_1's output -> the q4_1 matmul's layout (see cpu_kernels.c): uint8
    [ceil(N/16), K/32, 384], per tile and block four 64-byte nibble groups (group j, byte 4c + i: row c's
    byte 4j + i of the block, i.e. weights 4j + i and 16 + 4j + i), then d[16] and m[16] as float32.
    Rows past N are zero."""
    n, half = qs.shape
    nb = half * 2 // QK
    tiles = -(-n // Q4_TILE_ROWS)
    pad = tiles * Q4_TILE_ROWS - n
    qs, d, m = (F.pad(t, (0, 0, 0, pad)) for t in (qs, d.float(), m.float()))
    nibbles = qs.reshape(tiles, Q4_TILE_ROWS, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(tiles, nb, 256)
    scales = torch.stack([d, m], dim=2).reshape(tiles, Q4_TILE_ROWS, nb, 2).permute(0, 2, 3, 1)
    scales = scales.contiguous().view(torch.uint8).reshape(tiles, nb, 128)
    return torch.cat([nibbles, scales], dim=2).contiguous()


def unpack_q4_1(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_q4_1: (qs, d, m) of the first n rows."""
    tiles, nb, _ = packed.shape
    nibbles = packed[..., :256].reshape(tiles, nb, 4, Q4_TILE_ROWS, 4).permute(0, 3, 1, 2, 4)
    qs = nibbles.reshape(tiles * Q4_TILE_ROWS, nb * QK // 2)
    scales = packed[..., 256:].contiguous().view(torch.float32).reshape(tiles, nb, 2, Q4_TILE_ROWS)
    d, m = scales.permute(2, 0, 3, 1).reshape(2, tiles * Q4_TILE_ROWS, nb)
    return qs[:n].contiguous(), d[:n].contiguous(), m[:n].contiguous()


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n = q.shape[0]
    return (q.reshape(n, -1, QK).float() * d[..., None]).reshape(n, -1)


# ---------------------------------------------------------------- GGUF block types, kept as stored

# The block types of llama.cpp's files that baton_gemm_gq runs without dequantizing (see cpu_kernels.c), in
# the kernel's order: (bytes per block of the file, inputs per block, high-bit bytes, scale bytes and
# super-block bytes of a packed tile block).
GQ_FORMATS = {"q8_0": (34, 32, 256, 32, 0), "q4_0": (18, 32, 0, 32, 0), "q4_1": (20, 32, 0, 64, 0),
              "q5_0": (22, 32, 64, 32, 0), "q5_1": (24, 32, 64, 64, 0), "q4_k": (144, 256, 0, 32, 128),
              "q5_k": (176, 256, 64, 32, 128), "q6_k": (210, 256, 128, 32, 64),
              "i4": (0, 32, 0, 48, 0)}  # AWQ's and GPTQ's int4 groups (no GGUF type: built from a checkpoint)
GQ_OFFSET = {"q8_0": 128, "q4_0": 8, "q5_0": 16, "q6_k": 32}  # signed types: q is stored plus this


@dataclass
class GqBlocks:
    """A GGUF tensor's blocks split into what the tiles hold: q uint8 [N, K] (unsigned: a signed type's q plus
    its offset), and per format: d (float16 [N, K/32]: q8_0, q4_0, q5_0; q4_1 and q5_1 with m), or the
    k-quants' sc and m (uint8 [N, K/32]; q6_K: int8 sc [N, K/16]) with float32 d (and dmin) per super-block;
    i4 (AWQ, GPTQ): w = d * (q - sc), d float16 and sc uint8 zero points [N, K/32]. ``perm`` (GPTQ's act-order):
    column j of q holds input perm[j] (inputs sorted by group), so the matmul gathers x's columns first."""

    kind: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sc: torch.Tensor | None = None
    dmin: torch.Tensor | None = None
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def values(self) -> torch.Tensor:
        """The weights in float32 [N, K] (inputs in their own order), as llama.cpp (or AWQ, GPTQ) defines them."""
        n, k = self.q.shape
        q = self.q.float()
        if self.kind == "i4":
            w = self.d.float().repeat_interleave(QK, dim=1) * (q - self.sc.float().repeat_interleave(QK, dim=1))
            return w if self.perm is None else w[:, torch.argsort(self.perm)]
        if self.kind in ("q4_k", "q5_k"):
            scale = (self.d.repeat_interleave(8, dim=1) * self.sc.float()).repeat_interleave(QK, dim=1)
            low = (self.dmin.repeat_interleave(8, dim=1) * self.m.float()).repeat_interleave(QK, dim=1)
            return scale * q - low
        if self.kind == "q6_k":
            scale = (self.d.repeat_interleave(16, dim=1) * self.sc.float()).repeat_interleave(16, dim=1)
            return scale * (q - GQ_OFFSET["q6_k"])
        d = self.d.float().repeat_interleave(QK, dim=1)
        if self.m is not None:
            return d * q + self.m.float().repeat_interleave(QK, dim=1)
        return d * (q - GQ_OFFSET[self.kind])


def _bits(b: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [..., B] -> its bits [..., B * 8] (little-endian within each byte), n of them kept."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b[..., None] >> shifts) & 1).reshape(*b.shape[:-1], -1)[..., :n]


def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16)[..., 0]


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of q4_K/q5_K [..., 12] -> 6-bit scales and mins [..., 8]."""
    lo, hi = s[..., :4], s[..., 4:8]
    tail = s[..., 8:12]
    sc = torch.cat([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    m = torch.cat([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], dim=-1)
    return sc, m


def gq_blocks(kind: str, raw: torch.Tensor, k: int) -> GqBlocks:
    """A GGUF tensor's bytes (uint8, [N, row bytes]) of block type ``kind`` -> GqBlocks."""
    if kind not in GQ_FORMATS or kind == "i4":
        raise ValueError(f"unknown GGUF block type {kind!r}; known: {', '.join(k for k in GQ_FORMATS if k != 'i4')}")
    size, per, *_ = GQ_FORMATS[kind]
    if k % per:
        raise ValueError(f"{kind} needs an input dimension divisible by {per}, got {k}")
    n = raw.shape[0]
    r = raw.reshape(n, k // per, size)
    if kind in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        d = _f16(r[..., 0:2])
        m = _f16(r[..., 2:4]) if kind in ("q4_1", "q5_1") else None
        if kind == "q8_0":
            return GqBlocks(kind, (r[..., 2:].view(torch.int8).short() + 128).to(torch.uint8).reshape(n, k), d)
        qs = r[..., -16:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        if kind in ("q5_0", "q5_1"):
            qh = r[..., 4:8] if m is not None else r[..., 2:6]
            q = q | (_bits(qh, 32) << 4)
        return GqBlocks(kind, q.reshape(n, k), d, m)
    nsup = k // 256
    if kind == "q6_k":
        ql, qh = r[..., :128].reshape(n, nsup, 2, 64), r[..., 128:192].reshape(n, nsup, 2, 32)
        parts = [(ql[..., :32] & 0x0F) | ((qh & 3) << 4), (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
                 (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
        q = torch.stack(parts, dim=3).reshape(n, k)
        sc = r[..., 192:208].contiguous().view(torch.int8).reshape(n, k // 16)
        return GqBlocks(kind, q, _f16(r[..., 208:210]).float(), sc=sc)
    d, dmin = _f16(r[..., 0:2]).float(), _f16(r[..., 2:4]).float()
    sc, m = _k_scales(r[..., 4:16])
    qs = r[..., -128:].reshape(n, nsup, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [n, sup, chunk, low/high, 32]
    if kind == "q5_k":
        qh = r[..., 16:48].reshape(n, nsup, 1, 1, 32)
        bit = (torch.arange(8, dtype=torch.uint8).reshape(4, 2))[None, None, :, :, None]
        q = q | (((qh >> bit) & 1) << 4)
    return GqBlocks(kind, q.reshape(n, k), d, m.reshape(n, k // QK), sc.reshape(n, k // QK), dmin)


def int4_blocks(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor) -> GqBlocks:
    """Int4 groups (AWQ, GPTQ) -> GqBlocks of kind i4: q [N, K] (0..15), scales [G, N], zeros [G, N] (integers),
    groups [K] (each input's group: GPTQ's g_idx). Inputs are taken in group order (stable), which must put
    every block of 32 inside one group."""
    n, k = q.shape
    if k % QK:
        raise ValueError(f"int4 weights need an input dimension divisible by {QK}, got {k}")
    groups = groups.to(torch.int64)
    perm = torch.argsort(groups, stable=True)
    ordered = groups[perm].reshape(k // QK, QK)
    if not torch.equal(ordered, ordered[:, :1].expand_as(ordered)):
        raise ValueError(f"int4 groups must hold whole blocks of {QK} inputs (group sizes that are multiples of {QK})")
    if int(zeros.min()) < 0 or int(zeros.max()) > 255:
        raise ValueError("int4 zero points must lie in 0..255")
    block_group = ordered[:, 0]
    identity = torch.equal(perm, torch.arange(k))
    return GqBlocks("i4", (q if identity else q[:, perm]).to(torch.uint8).contiguous(),
                    scales.to(torch.float16)[block_group].T.contiguous(),
                    sc=zeros.to(torch.uint8)[block_group].T.contiguous(), perm=None if identity else perm)


def _tile_rows(t: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, X...] -> [tiles, 16, X...], rows past N zero."""
    pad = tiles * Q4_TILE_ROWS - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])
    return t.reshape(tiles, Q4_TILE_ROWS, *t.shape[1:])


def _nibbles(v: torch.Tensor) -> torch.Tensor:
    """[T, 16, nb, 32] 4-bit values -> [T, nb, 256] in the q4_1 tile lanes."""
    t, _, nb, _ = v.shape
    b = v[..., :16] | (v[..., 16:] << 4)
    return b.reshape(t, Q4_TILE_ROWS, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, 256)


def _per_row(v: torch.Tensor, tiles: int) -> torch.Tensor:
    """[N, blocks, ...] per-row values -> [T, blocks, bytes of the 16 rows], row-minor (lane c = row c)."""
    v = _tile_rows(v, tiles)
    v = v.movedim(1, -1) if v.dim() == 3 else v.permute(0, 2, 3, 1)
    return v.contiguous().view(torch.uint8).reshape(tiles, v.shape[1], -1)


def pack_gq(blocks: GqBlocks) -> tuple[torch.Tensor, int]:
    """GqBlocks -> (the tiles' bytes, uint8 [tiles, tile bytes], the format's index for the table)."""
    kind = blocks.kind
    _, _, high, _, sup = GQ_FORMATS[kind]
    n, k = blocks.q.shape
    nb, tiles = k // QK, -(-n // Q4_TILE_ROWS)
    q = _tile_rows(blocks.q.reshape(n, nb, QK), tiles)  # [T, 16, nb, 32]
    parts = [_nibbles(q & 0x0F)]
    hi = q >> 4
    if high == 256:
        parts.append(_nibbles(hi))
    elif high:
        bits = 1 if high == 64 else 2
        b = hi.reshape(tiles, Q4_TILE_ROWS, nb, 2, 4, 4)  # [T, c, nb, half, jj, i]
        if bits == 1:
            b = b.permute(0, 2, 1, 5, 3, 4).reshape(tiles, nb, Q4_TILE_ROWS, 4, 8)
            shift = torch.arange(8, dtype=torch.uint8)
        else:
            b = b.permute(0, 2, 3, 1, 5, 4)  # [T, nb, half, c, i, jj]
            shift = 2 * torch.arange(4, dtype=torch.uint8)
        parts.append((b << shift).sum(dim=-1, dtype=torch.uint8).reshape(tiles, nb, high))
    if kind in ("q4_k", "q5_k"):
        parts += [_per_row(blocks.sc, tiles), _per_row(blocks.m, tiles)]
    elif kind == "i4":
        parts += [_per_row(blocks.d.half(), tiles), _per_row(blocks.sc, tiles)]
    elif kind == "q6_k":
        parts.append(_per_row(blocks.sc.reshape(n, nb, 2), tiles))
    else:
        parts.append(_per_row(blocks.d, tiles))
        if blocks.m is not None:
            parts.append(_per_row(blocks.m, tiles))
    body = torch.cat(parts, dim=2)  # [T, nb, block bytes]
    if sup:
        heads = [_per_row(blocks.d.float(), tiles)] + ([_per_row(blocks.dmin.float(), tiles)]
                                                       if blocks.dmin is not None else [])
        body = torch.cat([torch.cat(heads, dim=2), body.reshape(tiles, nb // 8, -1)], dim=2)
    return body.reshape(tiles, -1).contiguous(), list(GQ_FORMATS).index(kind)


@dataclass
class GqWeight:
    """A weight [n, k] in the GGUF block types' tiles: data (uint8, every tile's bytes in row order) and table
    (int64 [tiles, 2]: byte offset and format of each tile)."""

    data: torch.Tensor
    table: torch.Tensor
    n: int
    k: int

    @property
    def kinds(self) -> list[str]:
        names = list(GQ_FORMATS)
        return sorted({names[int(f)] for f in self.table[:, 1].unique()})


def gq_stack(parts: list[GqBlocks]) -> list[GqBlocks]:
    """Consecutive parts of one type stacked into one (their rows need no alignment then)."""
    out: list[GqBlocks] = []
    for p in parts:
        if out and out[-1].kind == p.kind:
            last = out.pop()
            if (last.perm is None) != (p.perm is None) or (p.perm is not None and not torch.equal(last.perm, p.perm)):
                raise ValueError("the parts of a fused weight need the same input order")
            fields = [None if a is None else torch.cat([a, b]) for a, b in
                      ((last.q, p.q), (last.d, p.d), (last.m, p.m), (last.sc, p.sc), (last.dmin, p.dmin))]
            p = GqBlocks(p.kind, *fields, perm=p.perm)
        out.append(p)
    return out


def gq_weight(parts: list[GqBlocks]) -> GqWeight:
    """Parts stacked by rows (a fused projection's q, k and v, each in its own type) -> one GqWeight. Every
    part but the last must have a multiple of 16 rows (each tile is one format)."""
    k = parts[0].q.shape[1]
    datas, tables, offset = [], [], 0
    for i, p in enumerate(parts):
        if p.q.shape[1] != k:
            raise ValueError("the parts of a fused weight need the same input dimension")
        if i < len(parts) - 1 and p.q.shape[0] % Q4_TILE_ROWS:
            raise ValueError(f"a fused weight's parts need multiples of {Q4_TILE_ROWS} rows, got {p.q.shape[0]}")
        tiles, fmt = pack_gq(p)
        size = tiles.shape[1]
        offsets = offset + size * torch.arange(tiles.shape[0], dtype=torch.int64)
        tables.append(torch.stack([offsets, torch.full_like(offsets, fmt)], dim=1))
        datas.append(tiles.reshape(-1))
        offset += tiles.numel()
    return GqWeight(torch.cat(datas), torch.cat(tables).contiguous(), sum(p.q.shape[0] for p in parts), k)


def gemm_gq(x: torch.Tensor, w: GqWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, K] @ W^T (+ bias, float32) -> float32 [M, n]."""
    return _matmul("gq", x, (w.data, w.table), bias, torch.float32, w.n)


def gq_rows(w: GqWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows of W's values in float32 [len(rows), K] (an embedding lookup in the LM head's tiles)."""
    rows = rows.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), w.k)
    if rows.numel():
        rc = library().baton_gq_rows(w.data.data_ptr(), w.table.data_ptr(), w.k, rows.data_ptr(), rows.numel(),
                                     out.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"gq_rows failed ({rc})")
    return out


# ---------------------------------------------------------------- matmuls


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _matmul(name: str, x: torch.Tensor, weight: tuple[torch.Tensor, ...], bias: torch.Tensor | None,
            dtype: torch.dtype, n: int | None = None) -> torch.Tensor:
    """Calls baton_gemm_<name>(x, M, K, *weight, bias, N, y, threads); N = n, else weight[0]'s rows."""
    x = x.contiguous()
    mm, k = x.shape
    n = weight[0].shape[0] if n is None else n
    y = torch.empty(mm, n, dtype=dtype)
    if mm == 0:  # a pass that samples no row
        return y
    rc = getattr(library(), f"baton_gemm_{name}")(x.data_ptr(), mm, k, *(t.data_ptr() for t in weight), _ptr(bias),
                                                  n, y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"{name} matmul failed ({rc}) for x {tuple(x.shape)} and weight [{n}, {k}]")
    return y


def gemm_q4_1(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
              n: int | None = None) -> torch.Tensor:
    """x float32 [M, K] @ W^T (+ bias) -> float32 [M, n], packed = pack_q4_1(*quantize_q4_1(W)) and
    n = W's rows (default: the packed tiles' rows, a multiple of 16)."""
    return _matmul("q4_1", x, (packed,), bias, torch.float32, packed.shape[0] * Q4_TILE_ROWS if n is None else n)


def gemm_q8_0(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [M, K] @ dequantized(q, d)^T (+ bias) -> float32 [M, N]."""
    return _matmul("q8_0", x, (q, d), bias, torch.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' activation rounding in torch: x [M, K] -> (q float [M, K/32, 32], d [M, K/32])."""
    b = x.float().reshape(x.shape[0], -1, QK)
    d = b.abs().amax(dim=2) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(b * inv[..., None]), d


def reference_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the kernels compute, in float64 torch: int8-rounded activations times the dequantized weight."""
    q, d = quantize_activations(x)
    xr = (q * d[..., None]).reshape(x.shape).double()
    y = xr @ weight.double().T
    return (y if bias is None else y + bias.double()).float()


def has_bf16_gemm() -> bool:
    """Whether this build has the bfloat16 matmul (CPUs with AVX512-BF16)."""
    return available() and bool(library().baton_has_bf16_gemm())


def has_q4_vnni() -> bool:
    """Whether this build's integer block kernels use AVX-512 VNNI (see blocks_fast)."""
    return gq_loop() == "vnni"


def blocks_fast() -> bool:
    """Whether the integer block kernels (q4_1 and the GGUF types) run a SIMD loop, fast at every pass size
    (AVX-512 VNNI or AVX2); else their portable loop, fast only for a few rows."""
    return gq_loop() in ("vnni", "avx2")


def gq_loop() -> str:
    """Which loop the integer block matmuls (gemm_q4_1, gemm_gq) run here: "vnni" (AVX-512 VNNI), "avx2", "portable"
    (only a few rows fast: a fallback), or "" where the kernels do not build."""
    return ("portable", "avx2", "vnni")[library().baton_gq_loop()] if available() else ""


PACK_COLS = 32  # output columns per tile of the packed bfloat16 layout


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the bfloat16 matmul's layout (see cpu_kernels.c): tiles of 32 output columns,
    each [K/2, 32, 2], columns past N zero. Returned as [ceil(N/32) * 32, K] (same bytes)."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the bfloat16 matmul takes an even number of inputs, got {k}")
    rows = -(-n // PACK_COLS) * PACK_COLS
    padded = torch.zeros(rows, k, dtype=torch.bfloat16)
    padded[:n] = weight
    return padded.view(rows // PACK_COLS, PACK_COLS, k // 2, 2).permute(0, 2, 1, 3).reshape(rows, k).contiguous()


def unpack_bf16(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_bf16: [N, K] bfloat16."""
    rows, k = packed.shape
    return packed.view(rows // PACK_COLS, k // 2, PACK_COLS, 2).permute(0, 2, 1, 3).reshape(rows, k)[:n].contiguous()


def gemm_bf16(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
              n: int | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x bfloat16 [M, K] @ W^T (+ bias) -> [M, n], float32 accumulation, rounded once to bfloat16.
    packed = pack_bf16(W); n = W's rows (default: packed's, a multiple of 32). out_dtype float32
    returns the same bfloat16 values widened (one pass, no separate conversion)."""
    if out_dtype == torch.float32:
        return _matmul("bf16_f32", x, (packed,), bias, torch.float32, n)
    return _matmul("bf16", x, (packed,), bias, torch.bfloat16, n)


def read_bytes(tensors: list[torch.Tensor]) -> int:
    """Reads every byte of these (contiguous, CPU) tensors once, with the matmuls' threads and split, and
    returns the bytes' sum: a timing probe for reading a model's weights where they lie."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("read_bytes takes contiguous CPU tensors")
    n = len(tensors)
    ptrs = (ctypes.c_void_p * n)(*(t.data_ptr() for t in tensors))
    sizes = (ctypes.c_int64 * n)(*(t.numel() * t.element_size() for t in tensors))
    return library().baton_read_bytes(ptrs, sizes, n, torch.get_num_threads())


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) for float32 [M, N] on CPU (first index among equals, NaN largest)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"argmax_rows takes float32 [rows, n >= 1], got {x.dtype} {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        library().baton_argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def mask_rows_(x: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured output, in place: in each row ``rows[k]`` of x (float32 [M, N], contiguous, CPU) every
    token the k-th row of ``bitmask`` (int32 [len(rows), words]; bit j of word w is token 32 w + j) does not
    allow becomes -inf, and so does every token past the mask. Returns x."""
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"mask_rows_ takes contiguous float32 [rows, n], got {x.dtype} {tuple(x.shape)}")
    rows = rows.to(torch.int64).contiguous()
    bitmask = bitmask.to(torch.int32).contiguous()
    if bitmask.dim() != 2 or bitmask.shape[0] != rows.numel():
        raise ValueError(f"bitmask must be [{rows.numel()}, words] int32, got {tuple(bitmask.shape)}")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= x.shape[0]):
        raise ValueError(f"rows must be in [0, {x.shape[0]})")
    library().baton_mask_rows(x.data_ptr(), x.shape[1], rows.data_ptr(), rows.numel(), bitmask.data_ptr(),
                              bitmask.shape[1])
    return x


PAGED_DTYPES = (torch.float32, torch.bfloat16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """Same contract as kernels.paged_attention.paged_attention_decode, for float32 and bfloat16
    caches: q [batch, num_heads, head_dim] -> [batch, num_heads, head_dim] in q's dtype. ``window``: a
    sliding window (each row sees its last ``window`` keys), None for full attention."""
    if q.dtype not in PAGED_DTYPES or k_cache.dtype not in PAGED_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_decode takes float32 or bfloat16 tensors, got q {q.dtype}, cache {k_cache.dtype}")
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int64).contiguous()
    lens = seq_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    rc = library().baton_paged_decode(
        q.data_ptr(), int(q.dtype == torch.bfloat16), batch, num_heads, head_dim, k_cache.data_ptr(),
        v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), block_size, num_kv_heads, tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), scale, window or 0, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"paged decode attention failed ({rc}): q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    return out


CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}  # the prefill kernel's cache types


@functools.cache
def has_prefill_attention(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether :func:`prefill_chunks` runs here for this head size and query dtype (AVX-512; bfloat16
    queries also need AVX512-BF16; head_dim a multiple of 32, at most 256)."""
    return dtype in PAGED_DTYPES and bool(library().baton_has_prefill_attention(head_dim, int(dtype == torch.bfloat16)))


def amx() -> bool:
    """Whether the bfloat16 matmul (inputs a multiple of 32) and the bfloat16 prefill attention run on AMX
    tiles here: a CPU with AMX-BF16, kernels built for it, and the OS granting the tile state."""
    return bool(library().baton_amx())


def features() -> str:
    """What the CPU kernels use here, for start-up logs: "AVX512-BF16, VNNI, AMX", "AVX2", or "portable"."""
    if not available():
        return "unavailable"
    names = [name for name, has in (("AVX512-BF16", has_bf16_gemm()), ("VNNI", has_q4_vnni()),
                                    ("AVX2", gq_loop() == "avx2"), ("AMX", amx())) if has]
    return ", ".join(names) or "portable"


def set_amx(on: bool) -> bool:
    """Turns the AMX paths on or off in this process (off: vdpbf16ps, as on CPUs without AMX), for comparing
    them; returns :func:`amx`."""
    global _amx_on
    lib = library()
    with _lock:
        _amx_on = int(on)
        for each in _libs.values():
            each.baton_set_amx(_amx_on)
    return bool(lib.baton_amx())


def prefill_chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunks: Chunks, scale: float,
                   out: torch.Tensor, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   window: int | None = None) -> None:
    """Causal attention of every chunk over its sequence's paged context (the chunks' own K/V already
    written), in tiles (see cpu_kernels.c): the rows of ``out`` [num_rows, num_heads, head_dim] that the
    chunks name are written from q's (same shape and dtype). Caches float32, bfloat16 or int8 (with
    scales). ``window``: a sliding window (the query at position p sees keys p - window + 1 .. p), None
    for full attention. Precondition: ``has_prefill_attention(head_dim, q.dtype)``."""
    if q.dtype not in PAGED_DTYPES or out.dtype != q.dtype or k_cache.dtype not in CACHE_KINDS \
            or v_cache.dtype != k_cache.dtype or not (q.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"prefill_chunks: q {q.dtype} (contiguous), out {out.dtype}, caches {k_cache.dtype}")
    int8 = k_cache.dtype == torch.int8
    if int8 and (k_scale is None or v_scale is None):
        raise ValueError("prefill_chunks: int8 caches need their scales")
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    rc = library().baton_prefill_attention(
        q.data_ptr(), int(q.dtype == torch.bfloat16), num_heads, head_dim, k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_KINDS[k_cache.dtype], _ptr(k_scale) if int8 else None, _ptr(v_scale) if int8 else None, block_size,
        num_kv_heads, chunks.starts.shape[0], chunks.starts.data_ptr(), chunks.lens.data_ptr(), chunks.ctxs.data_ptr(),
        chunks.tables.data_ptr(), chunks.tables.shape[1], scale, window or 0, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"prefill attention failed ({rc}): q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                      scale: float, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Causal attention of one prompt chunk over its sequence's cache, its own K/V already written.
    q [n, num_heads, head_dim] are positions ctx - n .. ctx - 1 of a sequence whose tokens 0..ctx - 1
    sit at ``slots`` [ctx] (the sequence's slots from position 0, so block-aligned: slot t is in block
    slots[t // block_size]). Query i sees keys 0..ctx - n + i (the last ``window`` of them with a sliding
    window). Returns [n, num_heads, head_dim].
    The tiled kernel where it runs here, else each row as a decode query (float caches only)."""
    if q.shape[0] == 0:
        return q.new_empty(q.shape)
    q = q.contiguous()
    if has_prefill_attention(q.shape[-1], q.dtype) and k_cache.dtype in CACHE_KINDS:
        out = torch.empty_like(q)
        prefill_chunks(q, k_cache, v_cache, Chunks.of([(0, q.shape[0], slots)], k_cache.shape[1]), scale, out,
                       k_scale, v_scale, window)
        return out
    return paged_decode(q, k_cache, v_cache, *chunk_query_rows(slots, q.shape[0], k_cache.shape[1]), scale, window)


def chunk_query_rows(slots: torch.Tensor, n: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last n positions of a sequence whose tokens 0..ctx - 1 sit at ``slots`` [ctx] (block-aligned),
    as decode queries: each row's block table [n, ceil(ctx / block_size)] (one row, expanded) and
    context length [n] (the row at position p sees p + 1 keys)."""
    ctx = slots.shape[0]
    table = (slots[::block_size] // block_size).to(torch.int64)
    return table.expand(n, -1), torch.arange(ctx - n + 1, ctx + 1, dtype=torch.int64)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (when given), then RMSNorm of x times weight, for float32 or bfloat16
    rows [M, n] (contiguous; n <= 8192). Returns the normalized rows; bfloat16 normalizes in float32
    and rounds before the weight multiply, as transformers does."""
    if x.dtype not in PAGED_DTYPES or not x.is_contiguous() or x.shape[-1] > 8192:
        raise ValueError(f"add_rms_norm takes contiguous float32 or bfloat16 rows of at most 8192, got {x.dtype}")
    if delta is not None:
        delta = delta.contiguous()
    out = torch.empty_like(x)
    rc = library().baton_add_rms_norm(x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(),
                                      x.numel() // x.shape[-1], x.shape[-1], eps, int(x.dtype == torch.bfloat16),
                                      torch.get_num_threads())
    if rc:
        raise RuntimeError(f"add_rms_norm failed ({rc}) for x {tuple(x.shape)}")
    return out


def decode_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """A decode-only pass of one layer's attention in one call: rotary embedding of the q and k heads
    of ``qkv`` [batch, (num_heads + 2 * num_kv_heads) * head_dim] (in place), the K/V write at ``slots``
    and paged attention. cos/sin: the full [positions, head_dim] tables (signed sin, as
    baton.model.rope stores them); int64 positions, slots, block_tables, seq_lens.
    Returns [batch, num_heads * head_dim] in qkv's dtype. Same results as apply_rotary + write_kv +
    paged_decode (float32 exactly; bfloat16 up to the order of two roundings)."""
    if qkv.dtype not in PAGED_DTYPES or k_cache.dtype not in PAGED_DTYPES or cos.dtype != qkv.dtype:
        raise ValueError(f"decode_attention takes float32 or bfloat16, got qkv {qkv.dtype}, cache {k_cache.dtype}")
    if not (qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("decode_attention needs contiguous qkv and tables")
    batch = qkv.shape[0]
    head_dim = cos.shape[-1]
    out = torch.empty(batch, num_heads * head_dim, dtype=qkv.dtype)
    rc = library().baton_decode_attention(
        qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), batch, num_heads, num_kv_heads, head_dim, cos.data_ptr(),
        sin.data_ptr(), positions.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        int(k_cache.dtype == torch.bfloat16), k_cache.shape[1], slots.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), scale, window or 0, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"decode attention failed ({rc}): qkv {tuple(qkv.shape)}, cache {tuple(k_cache.shape)}")
    return out


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [M, 2n] (gate, up) -> silu(gate) * up [M, n], for float32 or bfloat16."""
    if gu.dtype not in PAGED_DTYPES or not gu.is_contiguous():
        raise ValueError(f"silu_mul takes contiguous float32 or bfloat16, got {gu.dtype}")
    m, n2 = gu.shape
    out = torch.empty(m, n2 // 2, dtype=gu.dtype)
    library().baton_silu_mul(gu.data_ptr(), out.data_ptr(), m, n2 // 2, int(gu.dtype == torch.bfloat16),
                             torch.get_num_threads())
    return out


# ---------------------------------------------------------------- whole decode layers


class LinearSpec(ctypes.Structure):
    """A linear layer for decode_layers: kind 0 = bfloat16 weight packed by pack_bf16 (bfloat16 bias),
    kind 1 = q4_1 weight packed by pack_q4_1 (float32 bias) for passes of up to ``rows`` rows, and
    ``dense`` (the same values packed by pack_bf16, with a bfloat16 bias) or nothing for larger ones; kind 2 =
    a GqWeight (w: its tiles, table: its tile table; float32 bias), every pass."""

    _fields_ = [("kind", ctypes.c_int), ("n", ctypes.c_int), ("k", ctypes.c_int), ("w", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("rows", ctypes.c_int), ("dense", ctypes.c_void_p),
                ("dense_bias", ctypes.c_void_p), ("table", ctypes.c_void_p)]


LORA_PARTS = 3  # most parts of a fused projection (q, k, v)


class LoraSpec(ctypes.Structure):
    """A projection's LoRA for decode_layers: every slot's stacked A (shrink) and each part's stacked B^T
    (expand, written to the output's columns from col), all packed by pack_bf16 (baton/model/lora.py
    LoraSlots); zeros (the default): no adapter targets the projection (or, for one expand, that part)."""

    _fields_ = [("shrink", LinearSpec), ("expand", LinearSpec * LORA_PARTS), ("parts", ctypes.c_int),
                ("col", ctypes.c_int * LORA_PARTS)]


class LayerSpec(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", LinearSpec),
                ("o", LinearSpec), ("gate_up", LinearSpec), ("down", LinearSpec), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p), ("lora", LoraSpec * 4),  # qkv, o, gate_up, down
                ("window", ctypes.c_int)]  # sliding window in tokens, 0: full attention


ANY_ROWS = 2**31 - 1  # a LinearSpec's rows for a kernel that takes passes of any size


def bf16_linear_spec(packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> LinearSpec:
    return LinearSpec(0, n, packed.shape[1], packed.data_ptr(), _ptr(bias), ANY_ROWS, None, None)


def gq_linear_spec(w: GqWeight, bias: torch.Tensor | None) -> LinearSpec:
    return LinearSpec(2, w.n, w.k, w.data.data_ptr(), _ptr(bias), ANY_ROWS, None, None, w.table.data_ptr())


def q4_1_linear_spec(packed: torch.Tensor, n: int, bias: torch.Tensor | None, rows: float,
                     dense: torch.Tensor | None = None, dense_bias: torch.Tensor | None = None) -> LinearSpec:
    """rows: the largest pass the q4_1 kernel takes (math.inf: any)."""
    return LinearSpec(1, n, packed.shape[1] * QK, packed.data_ptr(), _ptr(bias), int(min(rows, ANY_ROWS)),
                      _ptr(dense), _ptr(dense_bias))


def decode_layers(layers: ctypes.Array, x: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  inter: int, eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  cache_dtype: torch.dtype, block_size: int, slots: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, lora_rows: torch.Tensor | None = None,
                  lora_slots: int = 0) -> None:
    """Runs every layer of a decode-only pass on x [M, hidden] (the residual stream, updated in place):
    the same kernels in the same order as the model's loop over layers, in one call. ``layers``: a
    LayerSpec array whose tensors the caller keeps alive; int64 positions, slots, tables, lengths.
    lora_rows: int64 [M], each row's LoRA slot (-1: the base model), with the plan's LoraSpecs over
    ``lora_slots`` slots (bfloat16 rows only); None: no LoRA."""
    if x.dtype not in PAGED_DTYPES or not x.is_contiguous() or cache_dtype not in PAGED_DTYPES:
        raise ValueError(f"decode_layers takes contiguous float32 or bfloat16 rows, got {x.dtype}, {cache_dtype}")
    rc = library().baton_decode_layers(
        ctypes.addressof(layers), len(layers), x.data_ptr(), int(x.dtype == torch.bfloat16), x.shape[0], x.shape[1],
        num_heads, num_kv_heads, head_dim, inter, eps, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
        int(cache_dtype == torch.bfloat16), block_size, slots.data_ptr(), block_tables.data_ptr(),
        block_tables.shape[1], seq_lens.data_ptr(), scale, _ptr(lora_rows), lora_slots, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"decode layers failed ({rc}) for x {tuple(x.shape)}")

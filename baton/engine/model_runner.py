"""Turns a SchedulerOutput into tensors, runs the model and samples: no scheduling decisions here."""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import llguidance
import torch

from baton.api.params import TopLogprobs
from baton.engine.device import DTYPES
from baton.engine.sampling import Sampler, SamplingState
from baton.engine.scheduler import ScheduledSeq, SchedulerOutput
from baton.engine.sequence import Sequence
from baton.kernels.paged_attention import write_kv
from baton.memory import zeroed
from baton.model.attention import AttentionMetadata, DecodeBatch, LayerCache, PrefillSpan
from baton.model.llama import LlamaModel
from baton.model.lora import LoraBatch

# Takes a sampled token of a sequence (with its log-prob and top log-probs, None unless asked for); False when
# the sequence takes no more tokens in this pass (it stopped).
Accept = Callable[[Sequence, int, "float | None", "TopLogprobs | None"], bool]


def kernel_table(seq: Sequence) -> list[int]:
    """A sequence's block table for the kernels: its dropped entries (behind every layer's window, which no
    kernel reads) as block 0, like the padding of a shorter table."""
    d = seq.num_dropped_blocks
    return seq.block_ids if not d else [0] * d + seq.block_ids[d:]


def token_slots(block_ids: list[int], start: int, stop: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots of positions start..stop-1 of a block table (slot = block * block_size + offset)."""
    pos = torch.arange(start, stop)
    return (torch.tensor(block_ids, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size).to(device)


@dataclass
class KVSnapshot:
    """A request's K/V copied out of the pool, for a hand-off to another engine."""

    values: torch.Tensor  # [num_layers, 2, num_tokens, num_kv_heads, head_dim], the cache's dtype
    scales: torch.Tensor | None = None  # [num_layers, 2, num_tokens, num_kv_heads] float32, int8 only

    @property
    def num_tokens(self) -> int:
        return self.values.shape[2]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (self.scales.nbytes if self.scales is not None else 0)

    def dense(self) -> torch.Tensor:
        """Values as floating point (dequantized when int8)."""
        if self.scales is None:
            return self.values
        return self.values.float() * self.scales.unsqueeze(-1)


KV_DTYPES = {**DTYPES, "int8": torch.int8}  # --kv-dtype's names besides auto


def kv_cache_dtype(choice: str, model: LlamaModel, dtype: torch.dtype) -> torch.dtype:
    """--kv-dtype (a name of KV_DTYPES, or auto) for a model computing in ``dtype``. auto: the model's dtype,
    except bfloat16 for float32 on CPU when the model keeps a quantized file's blocks. Every decode step reads
    each sequence's whole context from the cache: at 16 sequences of a few hundred tokens that is more bytes
    than the default model's weights in float32, and half of them in bfloat16 (llama.cpp keeps float16 for such
    files)."""
    if choice != "auto":
        return KV_DTYPES[choice]
    return torch.bfloat16 if dtype == torch.float32 and model.weights.holds_file_blocks() else dtype


class KVCache:
    """Per-layer paged K and V ([num_blocks, block_size, num_kv_heads, head_dim] each); an int8 cache
    also holds per-token-per-head float32 scales."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        numel = num_blocks * block_size * num_kv_heads * head_dim
        scale_numel = numel // head_dim if dtype == torch.int8 else 0
        # On CPU the whole pool is one anonymous mapping of zeros, resident only as blocks are first written.
        pool = (zeroed(2 * num_layers * (numel * dtype.itemsize + scale_numel * 4)) if device.type == "cpu"
                else None)
        offset = 0

        def part(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nonlocal offset
            if pool is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            n = math.prod(shape) * dtype.itemsize
            t = pool[offset:offset + n].view(dtype).view(shape)
            offset += n
            return t

        self.layers = [LayerCache(part(shape, dtype), part(shape, dtype),
                                  part(shape[:-1], torch.float32) if scale_numel else None,
                                  part(shape[:-1], torch.float32) if scale_numel else None)
                       for _ in range(num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def _slots(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        if -(-num_tokens // self.block_size) > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need more than {len(block_ids)} blocks")
        return token_slots(block_ids, 0, num_tokens, self.block_size, self.device)

    def read(self, block_ids: list[int], num_tokens: int) -> KVSnapshot:
        """K and V of the first ``num_tokens`` positions of a block table (a copy)."""
        slots = self._slots(block_ids, num_tokens)
        values = torch.stack([torch.stack([c.k.flatten(0, 1)[slots], c.v.flatten(0, 1)[slots]])
                              for c in self.layers])
        scales = None
        if self.dtype == torch.int8:
            scales = torch.stack([torch.stack([c.k_scale.flatten(0, 1)[slots], c.v_scale.flatten(0, 1)[slots]])
                                  for c in self.layers])
        return KVSnapshot(values, scales)

    def write(self, block_ids: list[int], kv: KVSnapshot) -> None:
        """Place a snapshot into these blocks, converting (quantizing or dequantizing) if the dtypes differ."""
        c0 = self.layers[0]
        if kv.values.shape[0] != len(self.layers) or kv.values.shape[3:] != c0.k.shape[2:]:
            raise ValueError(f"KV of shape {tuple(kv.values.shape)} does not fit this cache")
        slots = self._slots(block_ids, kv.num_tokens)
        if self.dtype == torch.int8 and kv.scales is not None:
            for c, layer, sc in zip(self.layers, kv.values.to(self.device), kv.scales.to(self.device)):
                c.k.flatten(0, 1).index_copy_(0, slots, layer[0])
                c.v.flatten(0, 1).index_copy_(0, slots, layer[1])
                c.k_scale.flatten(0, 1).index_copy_(0, slots, sc[0])
                c.v_scale.flatten(0, 1).index_copy_(0, slots, sc[1])
            return
        dense = kv.dense().to(self.device)
        for c, layer in zip(self.layers, dense):
            write_kv(c.k, c.v, layer[0], layer[1], slots, c.k_scale, c.v_scale)

    @property
    def device(self) -> torch.device:
        return self.layers[0].k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].k.dtype

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        per_token_head = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
        return 2 * num_layers * block_size * num_kv_heads * per_token_head


class Masker:
    """Token masks of constrained rows. Rows whose mask must come before top-k / top-p / min-p get it on a
    thread of its own while the forward pass runs (llguidance computes them in Rust, without the GIL;
    torch releases it too), so that the other rows wait only for whatever part of the mask work outlasts
    the forward pass; the sampler asks for the others' (``compute``) only when their grammar refused the
    token they drew first (see baton/engine/sampling.py)."""

    def __init__(self, words: int, threads: int = 1) -> None:
        self.words = words  # int32 words per row: ceil(tokenizer vocabulary / 32)
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")
        self.last: tuple[float, float] | None = None  # (mask seconds, seconds waited after the forward pass)

    def start(self, states: list[SamplingState]) -> concurrent.futures.Future | None:
        self.last = None
        rows = [i for i, st in enumerate(states) if st.matcher is not None and not st.checks_first]
        if not rows:
            return None
        return self._thread.submit(self._compute, rows, [states[i].matcher.raw for i in rows])

    def compute(self, states: list[SamplingState]) -> torch.Tensor:
        """The bitmasks of these rows now, on the calling thread ([len(states), words] int32)."""
        _, bitmask, seconds = self._compute(list(range(len(states))), [st.matcher.raw for st in states])
        mask_s, wait_s = self.last or (0.0, 0.0)
        self.last = (mask_s + seconds, wait_s + seconds)
        return bitmask

    def _compute(self, rows: list[int], matchers: list) -> tuple[list[int], torch.Tensor, float]:
        t0 = time.perf_counter()
        bitmask = torch.zeros((len(rows), self.words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(),
                                               self.words * 4, len(rows))
        return rows, bitmask, time.perf_counter() - t0

    def finish(self, job: concurrent.futures.Future | None) -> tuple[list[int], torch.Tensor] | None:
        if job is None:
            return None
        t0 = time.perf_counter()
        rows, bitmask, seconds = job.result()
        self.last = (seconds, time.perf_counter() - t0)
        return rows, bitmask


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, sample_vocab_size: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        # Models often pad their embedding rows past the tokenizer's vocabulary; ids there have no
        # text, so they are never sampled.
        vocab = model.config.vocab_size
        self.sample_vocab_size = vocab if sample_vocab_size is None else min(sample_vocab_size, vocab)
        self.device = model.device
        self.sampler = Sampler()
        self.masker = Masker(-(-self.sample_vocab_size // 32))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, accept: Accept) -> list[int]:
        """Run the pass and sample: each sampling sequence's token goes to ``accept`` (with its log-prob and top
        log-probs when asked for), which says whether the sequence goes on. A decode with a draft then has its
        draft verified (``verify``). Returns, per decode in batch order, how many draft tokens were accepted."""
        bs = self.kv_cache.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        spans: list[PrefillSpan] = []
        lora_rows: list[int] = []  # each token's adapter slot, -1 for the base model
        dev = self.device
        for s in out.scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:start + s.num_tokens - len(s.draft)])
            input_ids.extend(s.draft)
            lora_rows.extend([seq.lora_slot] * s.num_tokens)
            pos = range(start, start + s.num_tokens)
            positions.extend(pos)
            table = kernel_table(seq)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if s.sample:  # a draft's rows all give logits: row i verifies draft token i
                logits_rows.extend(range(row + s.num_tokens - 1 - len(s.draft), row + s.num_tokens))
            if not s.is_decode:
                spans.append(self.prefill_span(row, start, s.num_tokens, table, bs))

        decode = None
        if out.decodes:
            # One decode row per token: a draft's row i is a decode query at its own position, over the same
            # table (its K/V and the rows before it are written before any row attends).
            rows = [(s.seq, s.seq.num_computed_tokens + 1 + i) for s in out.decodes for i in range(s.num_tokens)]
            width = max(len(seq.block_ids) for seq, _ in rows)
            tables = [kernel_table(seq) + [0] * (width - len(seq.block_ids)) for seq, _ in rows]
            block_tables = torch.tensor(tables, dtype=torch.int64, device=dev)
            seq_lens = torch.tensor([n for _, n in rows], device=dev)
            decode = DecodeBatch(len(rows), block_tables, seq_lens, bs)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev), decode, tuple(spans))
        lora = None
        if self.model.lora is not None and max(lora_rows, default=-1) >= 0:
            lora = LoraBatch(torch.tensor(lora_rows, dtype=torch.int64, device=dev), self.model.lora.num_slots,
                             self.model.dtype)
        sampling = [s for s in out.scheduled if s.sample]
        masks = self.masker.start([s.seq.sampling for s in sampling])  # structured output: masks while the model runs
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_cache.layers, meta,
            torch.tensor(logits_rows, dtype=torch.int64, device=dev), lora,
        )
        if not sampling:
            return []
        if self.sample_vocab_size < logits.shape[-1]:
            logits[:, self.sample_vocab_size:] = float("-inf")
        return self.verify(logits, sampling, accept, self.masker.finish(masks))

    def verify(self, logits: torch.Tensor, sampling: list[ScheduledSeq], accept: Accept,
               masks: tuple[list[int], torch.Tensor] | None = None) -> list[int]:
        """Sample each sequence's next token from its first logits row; while the token equals the sequence's
        next draft token (and ``accept`` lets it go on), sample the next one from the following row, whose
        context that draft token was. Each round samples every still-verifying sequence at once, with its
        state as it stands (penalties, constraint, the seeded draw of that position): every token is the one
        decoding without a draft would have drawn, so the output, seeded or greedy, is the same with
        speculation on or off. Returns the accepted draft tokens of each decode, in order.

        For a draft that is one proposal per position (prompt lookup, a greedy draft model), this is the
        rejection sampling of speculative decoding: the draft token is kept with the target probability p(d),
        and a rejected position's token is the target's draw conditioned on not being d, which is the
        residual distribution max(p - q, 0) with q the draft's one-hot."""
        base = []  # each sequence's first logits row
        row = 0
        for s in sampling:
            base.append(row)
            row += 1 + len(s.draft)
        accepted = [0] * len(sampling)
        active = list(range(len(sampling)))
        depth = 0
        while active:
            states = [sampling[i].seq.sampling for i in active]
            index = torch.tensor([base[i] + depth for i in active], dtype=torch.int64, device=logits.device)
            if depth:  # later rounds: the constrained rows that mask first get their masks now
                first = [k for k, st in enumerate(states) if st.matcher is not None and not st.checks_first]
                masks = (first, self.masker.compute([states[k] for k in first])) if first else None
            result = self.sampler(logits.index_select(0, index) if depth or len(active) < row else logits, states,
                                  masks, self.masker.compute)
            going = []
            for i, token, lp, top in zip(active, result.token_ids, result.logprobs, result.top_logprobs, strict=True):
                s = sampling[i]
                more = accept(s.seq, token, lp, top)
                if depth < len(s.draft) and token == s.draft[depth]:
                    accepted[i] += 1  # kept, also when it ends the sequence
                    if more:
                        going.append(i)
            active = going
            depth += 1
        return [n for s, n in zip(sampling, accepted, strict=True) if s.is_decode]

    def prefill_span(self, row: int, start: int, n: int, table: list[int], bs: int) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(row, n, None, None)
        dev = self.device
        ctx = start + n
        pos = torch.arange(ctx, device=dev)
        # Query i sits at position start + i and sees keys 0..start + i.
        mask = pos[None, :] <= (start + torch.arange(n, device=dev))[:, None]
        return PrefillSpan(row, n, token_slots(table, 0, ctx, bs, dev), mask)

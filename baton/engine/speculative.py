"""Speculative decoding: proposals for the next tokens of decoding sequences, and when to make them.

A decode pass at a small batch reads every weight to make one token per sequence; the same pass can also
compute a few proposed tokens per sequence for little more, and every proposal the model agrees with is a token
for free. Two proposers:

- prompt lookup (``NgramIndex``, in baton/engine/spec_state.py with the rest of a sequence's state): the
  longest recent suffix of the sequence (``ngram_max`` down to ``ngram_min`` tokens) that occurred earlier in
  its prompt or output proposes the tokens that followed it there. Free to make; right when the answer copies
  the prompt (edits, code, quotes, summaries with names).
- ``DraftProposer``: a small model with the same tokenizer runs ``k`` greedy steps over its own paged KV (see
  its docstring for where that KV comes from).

The model runner verifies (``ModelRunner.verify``): a proposal is kept while the target model's own draw at its
position is that token, so output is exactly what decoding without speculation gives.

``SpecController`` decides each pass how many proposed tokens to compute, from what it measures: each
sequence's acceptance (how often its proposals were kept) and the pass time at each number of rows. Proposal
token j of a sequence whose tokens are kept with probability a is worth a^j tokens; the controller adds the
most valuable proposal tokens of the batch while the expected tokens per second of the pass grows, so at a
large batch, where a wider pass costs its full compute, it proposes nothing by itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from baton.config import ConfigError
from baton.engine.model_runner import KVCache, ModelRunner, kernel_table, kv_cache_dtype
from baton.engine.sequence import Sequence
from baton.engine.spec_state import NgramIndex, SpecState
from baton.loader import ModelLoadError, load_model
from baton.model.attention import AttentionMetadata, DecodeBatch, make_backend
from baton.model.llama import LlamaModel

log = logging.getLogger(__name__)

SPEC_METHODS = ("ngram", "draft")

ACCEPT_EMA = 0.3  # weight of the latest pass in a sequence's acceptance
COST_EMA = 0.2  # weight of the latest pass in the time of a pass of that many rows
EXPLORE_EVERY = 32  # passes the controller proposes nothing in a row before it tries the best width once more


class SpecController:
    """How many proposed tokens each decoding sequence computes in the next pass (see the module docstring)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.cost: dict[int, float] = {}  # rows of a decode-only pass -> seconds (moving average)
        self._idle = 0  # passes in a row that proposed nothing though proposals were there

    def widths(self, seqs: list[Sequence], available: list[int], base: int) -> list[int]:
        """Per sequence, how many of its ``available`` proposed tokens to compute in a pass of ``base`` decodes."""
        # every candidate token: (its expected value, sequence, position); a sequence's tokens come in order
        gains = sorted(((s.spec.accept ** (j + 1), i) for i, s in enumerate(seqs) for j in range(available[i])),
                       key=lambda g: -g[0])
        if not gains:
            return [0] * len(seqs)
        if min(self.cost, default=base + 1) > base:  # a pass of this size never ran plain: measure that first
            return [0] * len(seqs)
        best, best_x, total = base / self.time(base), 0, float(base)
        for x, (g, _) in enumerate(gains, start=1):
            total += g
            rate = total / self.time(base + x)
            if rate > best:
                best, best_x = rate, x
        if best_x == 0:
            self._idle += 1
            if self._idle >= EXPLORE_EVERY:  # measure once more: the costs or the acceptance may have changed
                self._idle, best_x = 0, max(1, len(gains) // 2)
        else:
            self._idle = 0
        out = [0] * len(seqs)
        for _, i in gains[:best_x]:
            out[i] += 1
        return out

    def time(self, rows: int) -> float:
        """Estimated seconds of a decode-only pass of ``rows`` rows: measured, else interpolated between the
        nearest measured sizes; past the largest, its time grows by 3% a row (optimistic, until measured). Needs
        one measured size at or below ``rows``."""
        if rows in self.cost:
            return self.cost[rows]
        below = max((r for r in self.cost if r < rows), default=None)
        above = min((r for r in self.cost if r > rows), default=None)
        if above is None:
            return self.cost[below] * (1 + 0.03 * (rows - below))
        t = (rows - below) / (above - below)
        return self.cost[below] * (1 - t) + self.cost[above] * t

    def record(self, rows: int, seconds: float) -> None:
        old = self.cost.get(rows)
        self.cost[rows] = seconds if old is None else old + COST_EMA * (seconds - old)

    @staticmethod
    def learn(seq: Sequence, proposed: int, accepted: int) -> None:
        """A sequence's proposals of this pass: the first ``accepted`` of ``proposed`` were kept. Verification
        stops at the first miss, so the pass saw ``accepted`` kept tokens in ``accepted + 1`` trials (or all kept)."""
        if proposed:
            rate = 1.0 if accepted == proposed else accepted / (accepted + 1)
            seq.spec.accept += ACCEPT_EMA * (rate - seq.spec.accept)


@dataclass
class SpecStats:
    """Counts since start, as vLLM names them: passes where a sequence had a draft, draft tokens computed, draft
    tokens kept, and kept by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence made per pass with a draft: 1 (its own) + the kept draft tokens."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    """Proposes drafts for a pass's decodes (``propose``) and learns from the verified pass (``record``)."""

    def __init__(self, method: str, k: int, ngram_min: int, ngram_max: int, draft: DraftProposer | None = None,
                 adaptive: bool = True) -> None:
        if method not in SPEC_METHODS:
            raise ValueError(f"unknown speculative method {method!r}; choose {', '.join(SPEC_METHODS)}")
        if method == "draft" and draft is None:
            raise ValueError("speculative method draft needs a draft model")
        self.method, self.k, self.ngram_min, self.ngram_max = method, k, ngram_min, ngram_max
        self.draft = draft
        self.adaptive = adaptive  # False: always the full proposals (tests, measurements)
        self.controller = SpecController(k)
        self.stats = SpecStats(accepted_per_pos=[0] * k)

    def propose(self, decodes: list[Sequence], reserve: Callable[[Sequence, int], bool] | None = None
                ) -> dict[Sequence, list[int]]:
        """Drafts for a pass's decodes. reserve(seq, n): the blocks for the sequence's next n positions, False
        if the pool is short (a draft model writes its KV there before the pass)."""
        seqs = [s for s in decodes if not s.params.no_speculation]
        # no draft past max_tokens: a pass makes at most 1 + len(draft) tokens
        room = [min(self.k, s.params.max_tokens - s.num_output_tokens - 1) for s in seqs]
        seqs = [s for s, r in zip(seqs, room) if r > 0]
        room = [r for r in room if r > 0]
        if not seqs:
            return {}
        for s in seqs:
            if s.spec is None:
                s.spec = SpecState()
        if self.method == "ngram":
            for s in seqs:
                if s.spec.ngram is None:
                    s.spec.ngram = NgramIndex(self.ngram_min, self.ngram_max)
            proposals = [s.spec.ngram.propose(s.token_ids, r) for s, r in zip(seqs, room)]
            widths = (self.controller.widths(seqs, [len(p) for p in proposals], len(decodes))
                      if self.adaptive else [len(p) for p in proposals])
            return {s: p[:w] for s, p, w in zip(seqs, proposals, widths) if w}
        # a draft model: one width for all (its steps run in lockstep), the controller's largest
        widths = self.controller.widths(seqs, room, len(decodes)) if self.adaptive else room
        # the draft writes its KV for the proposal's positions into the sequence's own blocks: reserve them first
        k = max(widths, default=0)
        chosen = [(s, w) for s, w in zip(seqs, widths) if w and (reserve is None or reserve(s, k))]
        if not chosen:
            return {}
        drafts = self.draft.propose([s for s, _ in chosen], k)
        return {s: d[:w] for (s, w), d in zip(chosen, drafts) if w}

    def record(self, decodes: list[tuple[Sequence, int]], accepted: list[int], rows: int, seconds: float,
               decode_only: bool) -> None:
        """A verified pass: each decode's sequence and draft length, the draft tokens it kept, the pass's rows
        and seconds (a decode-only pass's time teaches the controller)."""
        st = self.stats
        for (seq, proposed), kept in zip(decodes, accepted, strict=True):
            if not proposed:
                continue
            st.num_drafts += 1
            st.num_draft_tokens += proposed
            st.num_accepted_tokens += kept
            for j in range(kept):
                st.accepted_per_pos[j] += 1
            seq.spec.drafts += 1
            seq.spec.draft_tokens += proposed
            seq.spec.accepted_tokens += kept
            SpecController.learn(seq, proposed, kept)
        if decode_only:
            self.controller.record(rows, seconds)


class DraftProposer:
    """A small model with the target's tokenizer proposes by greedy decoding.

    Its KV lives in a cache of its own shape with as many blocks as the target's, at the same block ids as the
    target's KV of the same sequence: the target's block table is the draft's too, so the scheduler's
    reservations, prefix sharing and frees cover both. A sequence's draft KV is computed here, on the decode
    side, at its first proposal (and again after a preemption): a prompt costs the draft a small fraction of
    what it costs the target (its weights are a fraction of the target's), the KV hand-off and the prefill
    workers stay as they are (they never load the draft), and the decode side has the draft's state whichever
    prefill worker, migration or cache hit gave it the target's. Each later proposal first computes the tokens
    since the last one (the kept proposal and the target's own token: one or two rows), then ``k - 1`` single
    rows.
    """

    def __init__(self, model: LlamaModel, kv_cache: KVCache, vocab_size: int) -> None:
        self.runner = ModelRunner(model, kv_cache, sample_vocab_size=vocab_size)
        self.vocab_size = self.runner.sample_vocab_size

    @classmethod
    def load(cls, config, target_config, target_tokenizer, num_blocks: int, max_positions: int,
             dtype: torch.dtype, device: torch.device) -> DraftProposer:
        """The draft model of an engine config, checked against the target (its tokenizer, id for id)."""
        if target_config.kv_window is not None:
            raise ConfigError("--speculative draft needs a target model whose layers keep the whole context "
                              "(this one drops blocks behind its sliding window)")
        try:
            loaded = load_model(config.spec_draft_model)
        except ModelLoadError as e:
            raise ConfigError(f"--spec-draft-model {config.spec_draft_model}: {e}") from e
        tok = loaded.tokenizer
        if tok.vocab_size != target_tokenizer.vocab_size or any(
                tok.token_bytes(i) != target_tokenizer.token_bytes(i) for i in range(tok.vocab_size)):
            raise ConfigError(f"--spec-draft-model {config.spec_draft_model}: its tokenizer is not the target's "
                              "(the draft must use the same vocabulary, id for id)")
        mc = loaded.config
        if mc.max_position_embeddings < max_positions:
            raise ConfigError(f"--spec-draft-model {config.spec_draft_model}: it reaches {mc.max_position_embeddings}"
                              f" positions, the target {max_positions} (lower --max-model-len)")
        model = LlamaModel(mc, loaded.weights, dtype, device, make_backend(config.attention, device),
                           max_positions=max_positions, weight_mode=config.weights)
        kv = KVCache(mc.num_layers, num_blocks, config.block_size, mc.num_kv_heads, mc.head_dim,
                     kv_cache_dtype(config.kv_dtype, model, dtype), device)
        log.info("draft model %s: %d layers, hidden %d", config.spec_draft_model, mc.num_layers, mc.hidden_size)
        return cls(model, kv, tok.vocab_size)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        """``k`` greedy tokens after each sequence's last token (blocks for its next ``k`` positions reserved)."""
        # first pass: each sequence's tokens its draft KV lacks (1 row: a decode row; more: a prefill span)
        todo = []
        for s in seqs:
            sp, ids = s.spec, s.token_ids
            known = 0
            if sp.draft_preemptions == s.num_preemptions:
                known = sp.draft_known
                for t, want in zip(sp.draft_tail, ids[known:]):
                    if t != want:
                        break
                    known += 1
            todo.append(min(known, len(ids) - 1))
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].token_ids) - todo[i] > 1)  # decodes first
        rows = [(seqs[i], todo[i], len(seqs[i].token_ids)) for i in order]
        last = self._forward(rows)
        out: list[list[int]] = [[] for _ in seqs]
        tokens = dict(zip(order, last))
        for i, s in enumerate(seqs):
            out[i].append(tokens[i])
            s.spec.draft_known, s.spec.draft_tail = len(s.token_ids), []
            s.spec.draft_preemptions = s.num_preemptions
        for _ in range(k - 1):
            rows = [(s, len(s.token_ids) + len(o) - 1, len(s.token_ids) + len(o)) for s, o in zip(seqs, out)]
            ctx = [s.token_ids + o for s, o in zip(seqs, out)]
            last = self._forward(rows, ctx)
            for s, o, t in zip(seqs, out, last):
                s.spec.draft_tail.append(o[-1])  # its KV is now written
                o.append(t)
        return out

    def _forward(self, rows: list[tuple[Sequence, int, int]], ctx: list[list[int]] | None = None) -> list[int]:
        """One pass over rows (sequence, first position, end position) of the given contexts (default: the
        sequences' tokens), decode rows first; returns the greedy token after each row's last position."""
        runner, bs, dev = self.runner, self.runner.kv_cache.block_size, self.runner.device
        input_ids, positions, slots, logits_rows, spans, dec = [], [], [], [], [], []
        for j, (s, start, end) in enumerate(rows):
            tokens = ctx[j] if ctx is not None else s.token_ids
            row = len(input_ids)
            table = kernel_table(s)
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            logits_rows.append(row + end - start - 1)
            if end - start == 1:
                dec.append((table, end))
            else:
                spans.append(runner.prefill_span(row, start, end - start, table, bs))
        decode = None
        if dec:
            width = max(len(t) for t, _ in dec)
            tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in dec], dtype=torch.int64, device=dev)
            lens = torch.tensor([n for _, n in dec], device=dev)
            decode = DecodeBatch(len(dec), tables, lens, bs)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev), decode, tuple(spans))
        logits = runner.model.forward(torch.tensor(input_ids, dtype=torch.int64, device=dev),
                                      torch.tensor(positions, dtype=torch.int64, device=dev),
                                      runner.kv_cache.layers, meta,
                                      torch.tensor(logits_rows, dtype=torch.int64, device=dev))
        return logits[:, :self.vocab_size].argmax(-1).tolist()


def make_speculator(config, model_config, tokenizer, num_blocks: int, max_positions: int, dtype: torch.dtype,
                    device: torch.device) -> Speculator:
    """The speculator an engine config asks for (``config.speculative`` ngram or draft)."""
    draft = None
    if config.speculative == "draft":
        draft = DraftProposer.load(config, model_config, tokenizer, num_blocks, max_positions, dtype, device)
    return Speculator(config.speculative, config.spec_tokens, config.spec_ngram_min, config.spec_ngram_max, draft)

"""Iteration-level scheduling: which sequences run in the next forward pass, and for how many tokens.

Every step, running sequences go first (each decode needs one token, an unfinished prefill takes the
next chunk), then waiting sequences are admitted while the token budget, the sequence limit and the
KV pool allow.

Chunked prefill (on by default): one prompt takes at most ``prefill_chunk`` tokens of a pass, so a
long prompt is computed over several passes that it shares with other prompts and with decodes;
a 4,000-token prompt does not hold up the short prompts behind it. Off: a prompt is computed in
one pass, alone in it when it is larger than the budget.

Prefill order: ``arrival`` serves prompts first come, first served. ``shortest`` (the default; made
for prefill workers, whose passes are all prompts) gives each pass to the prompts with the fewest tokens
left: the first of them may fill the pass, later ones only top it up to ``SHORTEST_FILL`` tokens, so
prompts finish one at a time. Two prompts in one pass both wait for the pair, and prompts that
finish together are handed to decode together, finish together and come back together: a convoy
that a closed loop never loses. A prompt's claim grows by ``prefill_aging`` tokens for each second it
does not lead a pass, so a long prompt still gets its turn while short ones keep arriving.

Priorities: interactive sequences wait ahead of batch ones. Preemption policy: when a running
sequence needs a block and none is free, the most recently admitted batch sequence not yet
scheduled in this pass is preempted, else the most recently admitted one (its blocks are freed; it
goes back to the head of its class in the waiting queue and is recomputed from its tokens later,
reusing whatever prefix stayed cached). Under prefill order "shortest" the running list is kept in
claim order, so "most recently admitted" reads "with the most tokens left".
The scheduler never touches tensors; the model runner makes no scheduling decisions.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from baton.api import FinishReason
from baton.api.params import check_stop
from baton.api.prefix import hash_block, hash_full_blocks
from baton.config import PREFILL_ORDERS, ConfigError, EngineConfig, default_of
from baton.engine.block_pool import BlockPool
from baton.engine.sequence import NO_BLOCK, Sequence, SequenceStatus

# Prefill order "shortest": a pass takes more prompts only while it holds fewer prompt tokens than this
# (a pass has a fixed cost of about a dozen tokens' compute on CPU; 64 keeps it under a fifth).
SHORTEST_FILL = 64

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    """The engine's scheduling settings (defaults: EngineConfig's, written there once)."""

    max_model_len: int
    max_num_seqs: int = default_of(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = default_of(EngineConfig, "max_num_batched_tokens")
    enable_prefix_caching: bool = default_of(EngineConfig, "enable_prefix_caching")
    eos_token_ids: frozenset[int] = frozenset()
    enable_chunked_prefill: bool = default_of(EngineConfig, "enable_chunked_prefill")
    # most tokens of one prompt per pass; default half the budget (prefill order "shortest": all of it)
    prefill_chunk: int | None = default_of(EngineConfig, "prefill_chunk")
    prefill_order: str = default_of(EngineConfig, "prefill_order")  # see the module docstring
    prefill_aging: float = 200.0  # shortest: tokens a prompt's claim grows by per second it does not lead a pass
    # The positions a query can still read when every layer has a sliding window (ModelConfig.kv_window): a
    # decoding sequence gives back the blocks wholly before it. None: every block stays until the request ends.
    window: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ConfigError(f"prefill_order must be one of {', '.join(PREFILL_ORDERS)}, got {self.prefill_order!r}")
        if self.prefill_aging < 0:
            raise ConfigError(f"prefill_aging must be >= 0, got {self.prefill_aging}")

    @property
    def shortest_first(self) -> bool:
        return self.prefill_order == "shortest"

    @property
    def chunk(self) -> int:
        """Most tokens one prompt computes in a pass (chunked prefill)."""
        if self.prefill_chunk:
            return self.prefill_chunk
        return self.max_num_batched_tokens if self.shortest_first else max(1, self.max_num_batched_tokens // 2)


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens to compute this pass, starting at seq.num_computed_tokens (drafts included)
    sample: bool  # this pass reaches the end of the known tokens: sample the next one
    # Speculative decoding: tokens proposed after the sequence's last one (baton/engine/speculative.py); the pass
    # computes them too (num_tokens = 1 + len(draft)) and the sampler verifies them.
    draft: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        """One token whose context is already cached (and its drafts): batched on the decode path."""
        return self.sample and self.num_tokens == 1 + len(self.draft)


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: tuple[ScheduledSeq, ...]
    prefills: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    finished: tuple[Sequence, ...] = ()  # ended at scheduling time: the KV pool cannot hold them

    @property
    def scheduled(self) -> tuple[ScheduledSeq, ...]:
        """All scheduled sequences in batch order (decodes first)."""
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start: a pool too small for the load shows here
        self._last_pass: float | None = None  # prefill order "shortest": when the last pass was planned
        self._leader: Sequence | None = None  # ... and the prompt that led it
        self._stopping: dict[Sequence, FinishReason] = {}  # a token of this pass ended them (see accept)

    # -- requests -------------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue behind every waiting sequence of the same or a more urgent class."""
        at = next((k for k, w in enumerate(self.waiting) if w.priority > seq.priority), len(self.waiting))
        self.waiting.insert(at, seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a sequence (done, stopped or cancelled) and release its blocks."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ---------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if not self.config.shortest_first:
            return self._schedule(hold_back=False)
        now = time.time()
        # Every prompt that did not lead the last pass has waited through it (or since it arrived).
        since = now - (self._last_pass if self._last_pass is not None else now)
        for seq in itertools.chain(self.waiting, self.running):
            if seq.num_uncomputed_tokens > 1 and seq is not self._leader:
                seq.prefill_wait += max(0.0, min(since, now - seq.arrival_time))
        self._last_pass = now
        self.running.sort(key=lambda s: (s.num_uncomputed_tokens > 1, self._claim(s)))  # decodes first
        self.waiting = deque(sorted(self.waiting, key=lambda s: self._claim(s)))
        out = self._schedule(hold_back=True)
        if out.is_empty and not out.preempted and not out.finished and self.num_unfinished:
            # Everything held back and nothing admitted (the pool is short): the arrival-order rules
            # (which preempt) make progress.
            out = self._schedule(hold_back=False)
        # Leading a pass is being served; topping one up is not (it still counts as sitting out).
        self._leader = out.prefills[0].seq if out.prefills else None
        return out

    def _claim(self, seq: Sequence) -> tuple[int, float]:
        """Prefill order "shortest": lower goes first. Tokens left, less what sitting out passes has
        earned (time in passes earns nothing: a long prompt being computed does not overtake the short
        prompts that arrive meanwhile)."""
        return seq.priority, seq.num_uncomputed_tokens - self.config.prefill_aging * seq.prefill_wait

    def _limit(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Prefill order "shortest": most tokens ``seq`` may compute in this pass. The first prompt of a
        pass may use the whole budget; later ones only fill the pass up to SHORTEST_FILL tokens, so a
        prompt that shares a pass rarely finishes in it beside another."""
        if seq.num_uncomputed_tokens <= 1:
            return budget  # a decode
        filled = sum(s.num_tokens for s in scheduled if not s.is_decode)
        return budget if filled == 0 else min(budget, SHORTEST_FILL - filled)

    def _gives_way(self, seq: Sequence) -> bool:
        """Prefill order "shortest": a running prompt waits while a waiting one has a better claim."""
        return (seq.num_uncomputed_tokens > 1 and len(self.running) < self.config.max_num_seqs
                and bool(self.waiting) and self._claim(self.waiting[0]) < self._claim(seq))

    def _schedule(self, hold_back: bool) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        out_of_room: list[Sequence] = []
        gave_way: list[Sequence] = []  # hold_back: running prompts behind a better waiting one

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            limit = budget
            if hold_back:
                limit = self._limit(seq, budget, scheduled)
                if limit > 0 and self._gives_way(seq):
                    gave_way.append(seq)
                    limit = 0
            n = self._tokens_for(seq, limit, scheduled) if limit > 0 else 0
            if n == 0:
                i += 1
                continue
            while not self._reserve(seq, n):
                if len(self.running) == 1:
                    # Alone and still no room: the pool cannot hold this sequence any longer.
                    out_of_room.append(seq)
                    self.finish(seq, FinishReason.LENGTH)
                    break
                # Batch before interactive, newest first, among those not yet scheduled in this pass.
                j = max(range(i, len(self.running)), key=lambda k: (self.running[k].priority, k))
                victim = self.running.pop(j)
                self._preempt(victim)
                preempted.append(victim)
                if victim in gave_way:
                    gave_way.remove(victim)
                if victim is seq:
                    break
            else:
                scheduled.append(self._scheduled(seq, n))
                budget -= n
                i += 1

        # Admit new work only when nothing had to be preempted: a full pool admits nothing.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            limit = self._limit(seq, budget, scheduled) if hold_back else budget
            if limit <= 0:
                break
            self._match_prefix(seq)
            n = self._tokens_for(seq, limit, scheduled)
            if n == 0 or not self._reserve(seq, n):
                self._release(seq)
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.scheduled_time is None:
                seq.scheduled_time = time.time()
            self.running.append(seq)
            scheduled.append(self._scheduled(seq, n))
            budget -= n

        for seq in gave_way:  # they fill what the admitted prompts left of the pass
            limit = self._limit(seq, budget, scheduled)
            n = self._tokens_for(seq, limit, scheduled) if limit > 0 else 0
            if n and self._reserve(seq, n):
                scheduled.append(self._scheduled(seq, n))
                budget -= n

        return SchedulerOutput(
            decodes=tuple(s for s in scheduled if s.is_decode),
            prefills=tuple(s for s in scheduled if not s.is_decode),
            preempted=tuple(preempted),
            finished=tuple(out_of_room),
        )

    def with_drafts(self, output: SchedulerOutput, drafts: dict[Sequence, list[int]],
                    same_bits_rows: float = math.inf) -> SchedulerOutput:
        """The pass with speculative drafts added to its decodes, as far as the token budget and the KV pool
        allow (blocks for a draft are reserved here; a draft that finds none is dropped, never preempting).
        same_bits_rows: the largest pass whose rows compute as in a one-row pass (the model's); a pass within it
        stays within it, so the drafts change no other row's bits."""
        if not drafts:
            return output
        budget = self.config.max_num_batched_tokens - output.num_tokens
        if output.num_tokens <= same_bits_rows:
            budget = min(budget, same_bits_rows - output.num_tokens)
        decodes = []
        for s in output.decodes:
            draft = drafts.get(s.seq, ())[:max(0, int(budget))]
            # never past the context: the last token of a draft sits at len(token_ids) + len(draft) - 1
            draft = draft[:max(0, self.config.max_model_len - len(s.seq.token_ids))]
            if draft and self._reserve(s.seq, 1 + len(draft)):
                budget -= len(draft)
                s = ScheduledSeq(s.seq, 1 + len(draft), True, tuple(draft))
            decodes.append(s)
        return SchedulerOutput(tuple(decodes), output.prefills, output.preempted, output.finished)

    def accept(self, seq: Sequence, token: int) -> bool:
        """Record a sampled token; False when it ends the sequence (which ``finish_pass`` then finishes), or
        the sequence had ended already in this pass (the token is not taken)."""
        if seq in self._stopping:
            return False
        seq.token_ids.append(token)
        seq.sampling.append(token)
        reason = self._check_stop(seq, token)
        if reason is not None:
            self._stopping[seq] = reason
            return False
        return True

    def finish_pass(self, output: SchedulerOutput, accepted: Seq[int] = ()) -> list[Sequence]:
        """Book a finished forward pass whose tokens went through ``accept``: the K/V now computed (a decode's
        last token and its ``accepted`` drafts, one count per decode in order; missing: none), the full blocks
        cached, and the sequences that stopped finished. Returns those."""
        counts = iter(accepted)
        for s in output.scheduled:
            seq = s.seq
            taken = next(counts, 0) if s.is_decode else 0
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_computed_tokens += (1 + taken) if s.is_decode else s.num_tokens
            if self.config.enable_prefix_caching:
                self._register_full_blocks(seq)
        finished = []
        for seq, reason in self._stopping.items():
            self.finish(seq, reason)
            finished.append(seq)
        self._stopping.clear()
        return finished

    def update(self, output: SchedulerOutput, sampled: Seq[int],
               on_token: Callable[[Sequence, int], None] | None = None) -> list[Sequence]:
        """Record a finished pass without drafts: ``sampled`` holds one token per sampling sequence, in batch
        order. Returns the sequences that finished (EOS, stop token, length)."""
        tokens = iter(sampled)
        for s in output.scheduled:
            if s.sample:
                token = next(tokens)
                self.accept(s.seq, token)
                if on_token is not None:
                    on_token(s.seq, token)
        return self.finish_pass(output)

    def check_integrity(self) -> None:
        """Pool invariants hold and every block in use belongs to exactly the sequences that hold it."""
        self.pool.check_integrity()
        holders: dict[int, int] = {}
        for seq in self.running:
            if any(b == NO_BLOCK for b in seq.held_block_ids) or any(
                    b != NO_BLOCK for b in seq.block_ids[:seq.num_dropped_blocks]):
                raise AssertionError(f"{seq.request_id}: dropped blocks are not exactly its first "
                                     f"{seq.num_dropped_blocks}")
            for b in seq.held_block_ids:
                holders[b] = holders.get(b, 0) + 1
        for b, n in holders.items():
            if self.pool.ref_count(b) != n:
                raise AssertionError(f"block {b} has ref {self.pool.ref_count(b)} but {n} holders")
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        if in_use != len(holders):
            raise AssertionError(f"{in_use} blocks in use but {len(holders)} held by running sequences")

    # -- internals --------------------------------------------------------------------------------------

    def _tokens_for(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Tokens ``seq`` computes this pass; 0 when it must wait for the next pass."""
        left = seq.num_uncomputed_tokens
        if self.config.enable_chunked_prefill:
            return min(left, budget, self.config.chunk)
        # Unchunked: the whole prompt in one pass; a prompt larger than the budget runs without other prefills.
        if left <= budget:
            return left
        return left if not any(not s.is_decode for s in scheduled) else 0

    def _scheduled(self, seq: Sequence, n: int) -> ScheduledSeq:
        return ScheduledSeq(seq, n, sample=seq.num_computed_tokens + n == len(seq.token_ids))

    def _check_stop(self, seq: Sequence, token: int) -> FinishReason | None:
        state = seq.sampling
        if state.constraint_failed:  # the grammar refused a token its own mask allowed: never claim "stop"
            log.error("request %s: the constraint refused token %d: %s", seq.request_id, token, state.matcher.error)
            return FinishReason.CANCELLED
        return check_stop(seq.params, token, seq.num_output_tokens, len(seq.token_ids), self.config.max_model_len,
                          self.config.eos_token_ids, state.constraint_done)

    def reserve(self, seq: Sequence, n: int) -> bool:
        """The blocks for a running sequence's next ``n`` positions (a speculative draft's lookahead); False,
        allocating nothing, if the pool is short."""
        return self._reserve(seq, n)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make sure the blocks for the next ``n`` tokens exist; False (nothing new allocated) if the pool is
        short."""
        bs = self.pool.block_size
        self._drop_behind_window(seq)
        need = -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need)
        if blocks is None:
            return False
        seq.block_ids.extend(blocks)
        return True

    def _drop_behind_window(self, seq: Sequence) -> None:
        """Give back the blocks wholly before the window of the next query, when every layer has a window.

        The next query sits at position p = num_computed_tokens and reads keys from p - window + 1 on; later
        queries read later keys, so a block that ends before that is never read again. Only once the sequence
        has output (a decode, or a preempted sequence's recompute): until its first token a prefill worker
        still exports the whole prompt's KV. With the prefix cache on, the full blocks are registered first, so a
        dropped block stays cached for others (the pool evicts it when it needs to)."""
        w = self.config.window
        if w is None or seq.num_output_tokens == 0:
            return
        behind = max(seq.num_computed_tokens - w + 1, 0) // self.pool.block_size
        behind = min(behind, len(seq.block_ids))
        if behind <= seq.num_dropped_blocks:
            return
        if self.config.enable_prefix_caching:
            self._register_full_blocks(seq)  # a hand-off's blocks are not registered yet: first, so they stay cached
        self.pool.free(seq.block_ids[seq.num_dropped_blocks:behind])
        seq.block_ids[seq.num_dropped_blocks:behind] = [NO_BLOCK] * (behind - seq.num_dropped_blocks)
        seq.num_dropped_blocks = behind

    def _match_prefix(self, seq: Sequence) -> None:
        """Start a (re)admitted sequence on the longest cached prefix of its tokens."""
        if not self.config.enable_prefix_caching or seq.block_ids:
            return
        bs = self.pool.block_size
        # Leave at least the last token to compute: its logits are needed.
        usable = (len(seq.token_ids) - 1) // bs
        if len(seq.block_hashes) < usable:
            seq.block_hashes = hash_full_blocks(seq.token_ids[: usable * bs], bs, seq.hash_root)
        hits = self.pool.match_prefix(seq.block_hashes[:usable])
        self.pool.take(hits)
        seq.block_ids = list(hits)
        seq.num_registered_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * bs
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _register_full_blocks(self, seq: Sequence) -> None:
        bs = self.pool.block_size
        full = seq.num_computed_tokens // bs
        while seq.num_registered_blocks < full:
            j = seq.num_registered_blocks
            if j == len(seq.block_hashes):
                parent = seq.block_hashes[-1] if j else seq.hash_root
                seq.block_hashes.append(hash_block(parent, seq.token_ids[j * bs:(j + 1) * bs]))
            self.pool.cache_block(seq.block_ids[j], seq.block_hashes[j])
            seq.num_registered_blocks += 1

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.held_block_ids)
        seq.block_ids = []
        seq.num_dropped_blocks = 0
        seq.num_registered_blocks = 0
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Ahead of its class: it was admitted before the ones still waiting.
        at = next((k for k, w in enumerate(self.waiting) if w.priority >= seq.priority), len(self.waiting))
        self.waiting.insert(at, seq)

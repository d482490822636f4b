"""Per-request sampling state and the batched sampler (the parameters are the request layer's:
``baton.api.params.SamplingParams``).

The sampler turns one row of logits per running request into one token id per request. The logits
pipeline is, in order:

    penalties (repetition, presence, frequency) -> constraint mask -> temperature -> top-k -> top-p
    -> min-p -> sample

The constraint mask (structured output) sets every token the request's grammar does not allow next to
-inf. A mask over a 49k vocabulary costs up to a few hundred microseconds a row (inside a JSON string
almost every token must be checked), so rows that can do without one do: a greedy row, or a sampled row
with no top-k / top-p / min-p, first picks as if free; if its grammar accepts the token (a check of
about a microsecond) the token stands, else the row's mask is computed and the row picks again among the
allowed tokens, with the same noise: the masked argmax of the logits (greedy) or of probs / noise.
Exact: in the exponential race the winner among the allowed tokens is distributed as p(t) / A (A the
allowed mass) and independent of whether a refused token beat it, so a refused row's second pick is the
draw sampling under the mask would have made; and no extra noise is drawn, so a seeded request's
generator advances as an unconstrained one's. Rows with top-k, top-p or min-p (whose cut depends on
which tokens the mask removes) get their masks computed by the model runner while the forward pass
runs (``masks``).

Greedy rows (temperature 0) take the argmax of the penalized logits; a batch where every row is greedy and
unpenalized costs exactly one argmax. Sampled rows draw with the exponential-race trick: each row draws
``[vocab]`` Exp(1) noise from its own ``torch.Generator`` and takes ``argmax(probs / noise)``, which picks
token ``i`` with probability ``probs[i]``. The generator is counter-based: before each draw it is re-seeded
from the request's seed and the position of the token being drawn (``draw_seed``), so the noise for output
token n depends on nothing but (seed, n). A seeded request therefore produces the same tokens whatever else
is in the batch, and a request continued on another worker (a migration, a prefill/decode hand-off) needs
only its seed to go on exactly as it would have.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from baton.api.params import SamplingParams, TopLogprobs
from baton.grammar import Matcher
from baton.kernels import cpu as cpu_kernels

__all__ = ["Sampler", "SamplerOutput", "SamplingState", "apply_penalties", "draw_seed", "seed_bytes", "seed_from_bytes"]

_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed for drawing output token ``position`` of a request seeded with ``seed``:
    splitmix64 of the pair, so neighbouring positions and neighbouring seeds give unrelated streams."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seed_bytes(seed: int | None) -> bytes:
    """A request's seed as it travels between workers (``sampler_state``): 8 bytes, little-endian; b"" for a
    greedy request."""
    return b"" if seed is None else seed.to_bytes(8, "little")


def seed_from_bytes(data: bytes) -> int | None:
    """The inverse of ``seed_bytes``; a ValueError for anything but 0 or 8 bytes."""
    if not data:
        return None
    if len(data) != 8:
        raise ValueError(f"sampler_state must be 8 bytes (the request's seed), not {len(data)}")
    return int.from_bytes(data, "little")

@dataclass
class SamplingState:
    """Sampling state of one running request; the scheduler owns it.

    ``output_token_ids`` is append-only: the scheduler appends each generated token after the step. The
    sampler keeps per-request token counts for the penalties and updates them incrementally from the
    entries appended since the last step (if the list ever shrinks, the counts are rebuilt).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    seed: int | None = None  # sampled requests: the seed every draw's generator seed derives from (draw_seed)
    matcher: Matcher | None = None  # the constraint's state (structured output): which tokens may come next
    constraint_failed: bool = False  # the matcher refused a sampled token (a bug): the request ends
    # Penalty bookkeeping, built lazily by the sampler (vocab size is known only from the logits).
    _output_counts: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _num_counted: int = field(default=0, init=False, repr=False, compare=False)
    _prompt_mask: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        device: torch.device | str,
        matcher: Matcher | None = None,
        seed: int | None = None,
    ) -> SamplingState:
        """A fresh state; sampled (non-greedy) requests get a generator on ``device`` and a seed: ``seed``
        (the one the request started with elsewhere), else ``params.seed``, else a random one. ``matcher``: the
        constraint's, at its start (``CompiledGrammar.matcher()``); required when the params carry a
        constraint."""
        if params.constraint is not None and matcher is None:
            raise ValueError("a constrained request needs its grammar's matcher")
        generator = None
        if not params.greedy:
            if seed is None:
                seed = params.seed if params.seed is not None else secrets.randbits(64)
            generator = torch.Generator(device=torch.device(device))
        else:
            seed = None
        return cls(params=params, prompt_token_ids=prompt_token_ids, output_token_ids=[], generator=generator,
                   seed=seed, matcher=matcher)

    def append(self, token: int) -> None:
        """Record a sampled token (and advance the constraint over it)."""
        self.output_token_ids.append(token)
        if self.matcher is not None and not self.matcher.consume(token):
            self.constraint_failed = True

    @property
    def checks_first(self) -> bool:
        """A constrained row that samples first and computes its mask only when the grammar refuses the
        token (see the module docstring); False for rows whose mask must come before top-k/top-p/min-p."""
        p = self.params
        return self.matcher is not None and (p.greedy or (p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0.0))

    @property
    def constraint_done(self) -> bool:
        """The constrained structure is complete and takes no more tokens."""
        return self.matcher is not None and self.matcher.done

    def output_counts(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """How often each token id occurs in ``output_token_ids``. Returns: [vocab_size] float32."""
        counts = self._output_counts
        if (
            counts is None
            or counts.shape[0] != vocab_size
            or counts.device != device
            or len(self.output_token_ids) < self._num_counted
        ):
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            self._num_counted = 0
        new_ids = self.output_token_ids[self._num_counted :]
        if new_ids:
            _check_token_ids("output_token_ids", new_ids, vocab_size)
            index = torch.tensor(new_ids, dtype=torch.long, device=device)
            counts.index_add_(0, index, torch.ones(len(new_ids), dtype=torch.float32, device=device))
        self._output_counts = counts
        self._num_counted = len(self.output_token_ids)
        return counts

    def prompt_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """Which token ids occur in the prompt. Returns: [vocab_size] bool."""
        mask = self._prompt_mask
        if mask is None or mask.shape[0] != vocab_size or mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if len(self.prompt_token_ids) > 0:
                ids = list(self.prompt_token_ids)
                _check_token_ids("prompt_token_ids", ids, vocab_size)
                mask[torch.tensor(ids, dtype=torch.long, device=device)] = True
            self._prompt_mask = mask
        return mask


def _check_token_ids(name: str, ids: Sequence[int], vocab_size: int) -> None:
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside the logits' vocabulary [0, {vocab_size})")


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[float | None]  # log-prob of the chosen token under the raw logits; None unless requested
    # The row's top_logprobs most likely tokens and their log-probs, most likely first; None unless requested.
    top_logprobs: list[TopLogprobs | None]


def apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Applies each row's repetition, presence and frequency penalties.

    Repetition (HF semantics) covers tokens seen in the prompt or the output: a positive logit is divided by
    the penalty, a negative one multiplied. Presence and frequency (OpenAI semantics) cover output tokens:
    ``logit -= presence * (count > 0) + frequency * count``.

    logits: [batch, vocab] float32 -- never modified; when no row has a penalty it is returned as is,
    otherwise a new tensor is returned.
    """
    rows = [i for i, state in enumerate(states) if state.params.has_penalties]
    if not rows:
        return logits
    vocab = logits.shape[1]
    device = logits.device
    params = [states[i].params for i in rows]
    row_index = torch.tensor(rows, dtype=torch.long, device=device)
    # counts: [num_rows, vocab] float32
    counts = torch.stack([states[i].output_counts(vocab, device) for i in rows])
    x = logits.index_select(0, row_index)  # x: [num_rows, vocab]

    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
        penalty = penalty[:, None]  # [num_rows, 1]
        seen = torch.stack([states[i].prompt_mask(vocab, device) for i in rows]) | (counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    if any(p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device)
        x = x - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(torch.float32)

    return logits.index_copy(0, row_index, x)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's token bitmask ([rows, words] int32, bit j of word w = token 32 w + j) -> [rows, vocab]
    bool, True where allowed; ids past the mask's words are not allowed."""
    rows, words = bitmask.shape
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().reshape(rows, words * 32)
    if words * 32 >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(rows, vocab - words * 32)], dim=1)


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """``logits`` with the rows' disallowed tokens at -inf (a new tensor unless ``inplace``). bitmask: one
    row of words per entry of ``rows``. On CPU the C kernel (a word of zeros or ones at a time); elsewhere
    torch."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()
            and cpu_kernels.available()):
        return cpu_kernels.mask_rows_(logits if inplace else logits.clone(), index, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
    masked = logits.index_select(0, index).masked_fill(~allowed, -math.inf)
    return logits.index_copy(0, index, masked)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax over the vocabulary: the C kernel on CPU where it builds (torch's CPU argmax reads
    float32 at about 1 GB/s), else torch. Same rules: first index among equals, NaN largest."""
    if x.device.type == "cpu" and cpu_kernels.available():
        return cpu_kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def _row_index(rows: list[int], batch: int, device: torch.device) -> torch.Tensor | None:
    """The rows as an index tensor, or None when they are the whole batch in order (no gather needed)."""
    if len(rows) == batch:
        return None
    return torch.tensor(rows, dtype=torch.long, device=device)


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


class Sampler:
    """Picks one token per row of logits; see the module docstring for the pipeline."""

    def __call__(self, logits: torch.Tensor, states: Sequence[SamplingState],
                 masks: tuple[list[int], torch.Tensor] | None = None,
                 compute_masks: Callable[[list[SamplingState]], torch.Tensor] | None = None) -> SamplerOutput:
        """logits: [batch, vocab], any float dtype on any device; states: one per row, in row order;
        masks: the constrained rows masked up front and their token bitmasks ([len(rows), words] int32);
        compute_masks: the bitmasks of the given states' rows now, for the rows that check first."""
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch, _ = logits.shape
        if len(states) != batch:
            raise ValueError(f"got {len(states)} sampling states for {batch} rows of logits")
        if batch == 0:
            return SamplerOutput(token_ids=[], logprobs=[], top_logprobs=[])
        device = logits.device

        raw = logits.float()  # raw: [batch, vocab] float32; read-only from here on
        processed = apply_penalties(raw, states)
        if masks is not None and masks[0]:
            processed = apply_masks(processed, *masks, inplace=processed is not raw)  # raw stays: log-probs

        masked = set(masks[0]) if masks is not None else set()
        check = [i for i, state in enumerate(states) if state.matcher is not None and i not in masked]
        token_ids, scores = self._pick(processed, states, keep_scores=bool(check))
        ids = token_ids.tolist() if check else []
        refused = [i for i in check if not states[i].matcher.allows(ids[i])]
        if refused:  # the same scores, among the allowed tokens only
            if compute_masks is None:
                raise ValueError("constrained rows without masks need compute_masks")
            index = torch.tensor(refused, dtype=torch.long, device=device)
            again = apply_masks(scores.index_select(0, index), list(range(len(refused))),
                                compute_masks([states[i] for i in refused]), inplace=True)
            token_ids[index] = _argmax(again)

        logprob_rows = [i for i, state in enumerate(states) if state.params.logprobs]
        logprobs: list[float | None] = [None] * batch
        top: list[TopLogprobs | None] = [None] * batch
        if logprob_rows:
            logprob_index = _row_index(logprob_rows, batch, device)
            chosen_ids = _take(token_ids, logprob_index)[:, None]  # [rows, 1]
            all_logprobs = torch.log_softmax(_take(raw, logprob_index), dim=-1)  # [rows, vocab]
            values = all_logprobs.gather(1, chosen_ids)[:, 0]
            for row, value in zip(logprob_rows, values.tolist(), strict=True):
                logprobs[row] = value
            k = max(states[row].params.top_logprobs for row in logprob_rows)
            if k:
                top_values, top_ids = all_logprobs.topk(min(k, all_logprobs.shape[1]), dim=-1)  # [rows, k]
                for row, ids, vals in zip(logprob_rows, top_ids.tolist(), top_values.tolist(), strict=True):
                    n = states[row].params.top_logprobs
                    if n:
                        top[row] = TopLogprobs(ids[:n], vals[:n])
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs, top_logprobs=top)

    def _pick(self, processed: torch.Tensor, states: Sequence[SamplingState], keep_scores: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per row: the argmax for greedy rows, a draw for the others. Returns [rows] long and,
        with ``keep_scores``, what each row took the argmax of ([rows, vocab] float32: the logits for greedy
        rows, probs / noise for sampled ones); else None."""
        batch, device = processed.shape[0], processed.device
        sampled_rows = [i for i, state in enumerate(states) if not state.params.greedy]
        if not sampled_rows:
            return _argmax(processed), processed if keep_scores else None  # [batch]
        sampled_index = _row_index(sampled_rows, batch, device)
        ratio = self._sample(_take(processed, sampled_index), [states[i] for i in sampled_rows])
        if sampled_index is None:
            return _argmax(ratio), ratio if keep_scores else None
        scores = processed.clone()
        scores[sampled_index] = ratio
        return _argmax(scores), scores if keep_scores else None

    @staticmethod
    def _sample(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row from the row's own generator.

        logits: [rows, vocab] float32 (penalized). Returns: [rows, vocab] float32 probs / noise, whose
        argmax is the row's draw.
        """
        rows, vocab = logits.shape
        device = logits.device
        params = [state.params for state in states]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        x = logits / temperature[:, None]  # x: [rows, vocab]

        use_top_k = any(0 < p.top_k < vocab for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_k or use_top_p:
            # Stable sort: among tied logits the lowest id ranks first, as argmax would pick it.
            sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # both [rows, vocab]
            if use_top_k:
                k_values = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
                k = torch.tensor(k_values, dtype=torch.long, device=device)
                rank = torch.arange(vocab, device=device)  # [vocab]
                sorted_x = sorted_x.masked_fill(rank[None, :] >= k[:, None], -math.inf)
            if use_top_p:
                # Keep the smallest set of top tokens whose mass reaches top_p: drop a token when the mass
                # ranked strictly above it already does. The top token always stays.
                sorted_probs = torch.softmax(sorted_x, dim=-1)
                mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
                # Rows with top_p == 1 get a threshold no rounding can reach.
                top_p = torch.tensor(
                    [p.top_p if p.top_p < 1.0 else 2.0 for p in params], dtype=torch.float32, device=device
                )
                drop = mass_above >= top_p[:, None]
                drop[:, 0] = False
                sorted_x = sorted_x.masked_fill(drop, -math.inf)
            x = torch.empty_like(x).scatter_(1, order, sorted_x)

        if any(p.min_p > 0.0 for p in params):
            probs = torch.softmax(x, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [rows, 1]
            x = x.masked_fill(probs < threshold, -math.inf)

        probs = torch.softmax(x, dim=-1)  # [rows, vocab]
        # Exponential race: argmax(probs / E) with E ~ Exp(1) i.i.d. picks token i with probability probs[i].
        noise = torch.empty_like(probs)
        for row, state in enumerate(states):
            generator = state.generator
            if generator is None:
                raise ValueError(
                    "a sampled (temperature > 0) request has no generator; build it with SamplingState.create"
                )
            if generator.device.type != device.type:
                raise ValueError(
                    f"the request's generator is on {generator.device} but the logits are on {device}; "
                    "create the SamplingState with the logits' device"
                )
            generator.manual_seed(draw_seed(state.seed or 0, len(state.output_token_ids)))
            noise[row].exponential_(generator=generator)
        # A zero draw would make 0 / 0 = NaN for masked tokens; the smallest normal float keeps them at 0.
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        return probs.div_(noise)

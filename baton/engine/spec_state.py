"""A sequence's speculative-decoding state (``Sequence.spec``): its acceptance record and its proposers' state.
Kept apart from baton/engine/speculative.py, which proposes and decides, so that a Sequence can hold it without
importing the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

# Acceptance before a sequence has a record: each proposed token kept with this probability (the controller's
# optimism; measurements replace it after a few passes).
PRIOR_ACCEPT = 0.6


@dataclass
class NgramIndex:
    """Where each n-gram of a sequence's tokens last ended (the index of the token after it), for the lengths
    ``ngram_min``..``ngram_max``; grown by the tokens added since the last lookup."""

    ngram_min: int
    ngram_max: int
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this index are in ``ends``

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the sequence's last n tokens."""
        end = len(tokens)
        # every n-gram that ends before the last token: the suffix itself must not find itself
        for e in range(max(self.indexed, 1), end):
            for n in range(self.ngram_min, min(self.ngram_max, e) + 1):
                self.ends[tuple(tokens[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        for n in range(min(self.ngram_max, end - 1), self.ngram_min - 1, -1):
            e = self.ends.get(tuple(tokens[end - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []


@dataclass
class SpecState:
    """A sequence's speculation record."""

    accept: float = PRIOR_ACCEPT  # how often a proposed token is kept (moving average)
    ngram: NgramIndex | None = None
    drafts: int = 0  # passes with proposed tokens for this sequence, those tokens, and of them the kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    # A draft model's KV of this sequence (in the draft's cache, at the sequence's own block ids): positions
    # 0..draft_known-1 hold the sequence's tokens, then draft_tail's tokens (its latest proposal) follow;
    # draft_preemptions: the sequence's preemptions when they were written (a preemption gives the blocks up).
    draft_known: int = 0
    draft_tail: list[int] = field(default_factory=list)
    draft_preemptions: int = 0

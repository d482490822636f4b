"""A request's state while the engine works on it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from baton.api.params import FinishReason, Priority, SamplingParams
from baton.api.prefix import BlockHash
from baton.engine.sampling import SamplingState
from baton.engine.spec_state import SpecState

# A block-table entry whose block was given back: every layer's window has passed it (see
# Scheduler._drop_behind_window). No kernel reads it; tables sent to the kernels carry block 0 there.
NO_BLOCK = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    num_prompt_tokens: int
    sampling: SamplingState
    arrival_time: float  # wall clock (time.time()), like the two below: they become span and metric times
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = field(default_factory=list)  # by position // block size; NO_BLOCK once dropped
    num_dropped_blocks: int = 0  # the leading block_ids that are NO_BLOCK
    # Hashes of full blocks, in order; the first `num_registered_blocks` are in the pool's index.
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    scheduled_time: float | None = None  # first admitted into a forward pass
    first_token_time: float | None = None  # first output token sampled (or, handed off, arrived)
    priority: Priority = Priority.INTERACTIVE
    prefill_wait: float = 0.0  # seconds this prompt waited without leading a pass (prefill order "shortest")
    # LoRA: the model slot of the request's adapter (-1: the base model), and the root its block hash chain
    # starts from (the adapter's content, baton/api/prefix.py adapter_root; None for the base model)
    lora_slot: int = -1
    hash_root: BlockHash | None = None
    spec: SpecState | None = None  # speculative decoding: its acceptance and proposer state, from the first draft

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError("a sequence needs a non-empty prompt")

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this sequence holds (its table without the dropped entries)."""
        return self.block_ids[self.num_dropped_blocks:]

    @property
    def params(self) -> SamplingParams:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

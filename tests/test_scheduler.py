"""Scheduler policy on its own (no tensors): which prompts a pass takes, and how many tokens each."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.api import SamplingParams
from baton.engine.block_pool import BlockPool
from baton.engine.sampling import SamplingState
from baton.engine.scheduler import SHORTEST_FILL, Scheduler, SchedulerConfig
from baton.engine.sequence import Sequence


def _seq(name: str, n: int, arrival: float = 0.0, max_tokens: int = 4) -> Sequence:
    ids = [(hash(name) + i) % 1000 for i in range(n)]  # distinct per name: no prefix sharing
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Sequence(name, ids, n, SamplingState(params, ids), arrival)


def _scheduler(order: str, budget: int = 256, blocks: int = 1024, **kw) -> Scheduler:
    config = SchedulerConfig(max_model_len=4096, max_num_batched_tokens=budget, prefill_order=order,
                             enable_prefix_caching=False, **kw)
    return Scheduler(config, BlockPool(blocks, 16))


def _step(s: Scheduler) -> dict[str, int]:
    """One pass, the sampled token always 7; returns tokens per request."""
    out = s.schedule()
    s.update(out, [7] * sum(x.sample for x in out.scheduled))
    s.check_integrity()
    return {x.seq.request_id: x.num_tokens for x in out.scheduled}


def test_arrival_order_shares_passes_in_half_budget_chunks():
    s = _scheduler("arrival")
    for name, n in (("a", 200), ("b", 80), ("c", 120)):
        s.add(_seq(name, n))
    assert _step(s) == {"a": 128, "b": 80, "c": 48}


def test_shortest_first_one_prompt_at_a_time():
    s = _scheduler("shortest")
    for name, n in (("a", 200), ("b", 80), ("c", 120)):
        s.add(_seq(name, n, arrival=1e12))  # arrivals in the future: no aging in this test
    assert _step(s) == {"b": 80}
    assert _step(s) == {"b": 1, "c": 120}  # b decodes (one token each) beside the next prompt
    assert _step(s) == {"b": 1, "c": 1, "a": 200}


def test_shortest_first_tops_small_prompts_up_to_the_fill():
    s = _scheduler("shortest")
    for name, n in (("a", 40), ("b", 30), ("c", 50)):
        s.add(_seq(name, n, arrival=1e12))
    # b (30) leads; a may add only SHORTEST_FILL - 30 tokens, so it finishes in the next pass, alone.
    assert _step(s) == {"b": 30, "a": SHORTEST_FILL - 30}
    # a's rest (6) leads; c (50) fits in what is left of the fill.
    assert _step(s) == {"b": 1, "a": 40 - (SHORTEST_FILL - 30), "c": 50}


def test_a_long_prompt_gives_way_to_a_short_arrival_and_fills_after_it():
    s = _scheduler("shortest")
    s.add(_seq("long", 1000, arrival=1e12))
    assert _step(s) == {"long": 256}
    s.add(_seq("short", 40, arrival=1e12, max_tokens=1))  # done with its first token
    assert _step(s) == {"short": 40, "long": SHORTEST_FILL - 40}
    assert _step(s) == {"long": 256}


def test_sitting_out_passes_earns_a_long_prompt_its_turn(monkeypatch):
    """The long prompt's claim grows only while it does not lead a pass: the short prompts that keep
    arriving lead until it has waited long enough, then it leads."""
    from baton.engine import scheduler as sched

    clock = [1000.0]
    monkeypatch.setattr(sched.time, "time", lambda: clock[0])
    s = _scheduler("shortest", budget=256)
    s.add(_seq("long", 4000, arrival=clock[0]))
    assert _step(s) == {"long": 256}
    leads = []
    for i in range(30):  # a fresh 40-token prompt before every pass; each pass takes a second
        clock[0] += 1.0
        s.add(_seq(f"short-{i}", 40, arrival=clock[0] - 0.5, max_tokens=1))
        got = _step(s)
        if got.get("long") == 256:
            leads.append(i)
    # Pass i: the long prompt has 3744 - 24 i tokens left (topped up by 24 a pass) and has sat out
    # i + 1 s: claim 3544 - 224 i; a fresh short one's is 40 - 200 * 0.5 = -60. It leads from i = 17.
    assert leads and leads[0] == 17, leads


def test_time_spent_in_passes_earns_nothing(monkeypatch):
    from baton.engine import scheduler as sched

    clock = [1000.0]
    monkeypatch.setattr(sched.time, "time", lambda: clock[0])
    s = _scheduler("shortest", budget=256)
    s.add(_seq("long", 4000, arrival=clock[0]))
    for _ in range(10):  # ten seconds computing, alone
        assert _step(s) == {"long": 256}
        clock[0] += 1.0
    s.add(_seq("short", 40, arrival=clock[0], max_tokens=1))
    assert _step(s) == {"short": 40, "long": SHORTEST_FILL - 40}


def test_shortest_first_preempts_when_the_pool_runs_out():
    # 3 blocks of 16: two 24-token prompts cannot both grow; the scheduler must still make progress.
    s = _scheduler("shortest", blocks=3)
    s.add(_seq("a", 24, arrival=1e12, max_tokens=20))
    s.add(_seq("b", 20, arrival=1e12, max_tokens=20))
    done = set()
    for _ in range(200):
        if not s.num_unfinished:
            break
        out = s.schedule()
        finished = s.update(out, [7] * sum(x.sample for x in out.scheduled))
        done.update(q.request_id for q in finished + list(out.finished))
        s.check_integrity()
    assert done == {"a", "b"} and not s.num_unfinished


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 300), st.integers(1, 6)), min_size=1, max_size=12),
       st.sampled_from(["arrival", "shortest"]), st.integers(0, 2**32))
def test_every_prompt_finishes_with_its_tokens(requests, order, seed):
    """Whatever the order and arrival times: every request gets exactly max_tokens tokens, no pass exceeds
    the budget, and the pool is whole at the end."""
    rng = random.Random(seed)
    s = _scheduler(order, budget=128, blocks=64)
    pending = [_seq(f"r{i}", n, arrival=rng.uniform(0, 1e12), max_tokens=m) for i, (n, m) in enumerate(requests)]
    for _ in range(5000):
        if pending and rng.random() < 0.5:
            s.add(pending.pop())
        if not s.num_unfinished and not pending:
            break
        out = s.schedule()
        assert out.num_tokens <= 128
        finished = s.update(out, [7] * sum(x.sample for x in out.scheduled))
        for q in finished:
            assert q.num_output_tokens == q.params.max_tokens
        s.check_integrity()
    assert not s.num_unfinished and not pending
    assert s.pool.num_free_blocks == s.pool.num_blocks


def test_unknown_prefill_order_is_refused():
    with pytest.raises(ValueError, match="prefill_order"):
        SchedulerConfig(max_model_len=16, prefill_order="random")

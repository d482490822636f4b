"""Engine behaviour on a tiny random Llama: stops, seeds, cancellation, logprobs, bad input."""

from __future__ import annotations

import pytest
import torch
import transformers

from baton.api import InvalidRequestError, SamplingParams
from baton.config import EngineConfig
from baton.engine.engine import LLMEngine
from baton.loader import load_model
from tests.oracle import hf_greedy


@pytest.fixture(scope="module")
def loaded(tiny_llama_dir):
    return load_model(str(tiny_llama_dir))


@pytest.fixture()
def engine(loaded):
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4),
                     loaded=loaded)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_max_tokens_and_usage(engine, loaded):
    p = _prompt(9, 1, loaded.config.vocab_size)
    (out,) = engine.generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert (out.finish_reason, out.completion_tokens, out.prompt_tokens) == ("length", 5, 9)
    assert len(out.token_ids) == 5


def test_stop_string_is_cut_and_ends_request(engine, loaded):
    p = _prompt(7, 2, loaded.config.vocab_size)
    full = engine.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    assert len(full) > 12, "the tiny tokenizer should produce some text"
    stop = full[6:9]
    first = full.index(stop)
    (out,) = engine.generate([p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == full[:first]


def test_stop_token_id(engine, loaded):
    p = _prompt(7, 3, loaded.config.vocab_size)
    full = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    stop_id = full[4]
    (out,) = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                 stop_token_ids=(stop_id,)))
    assert out.finish_reason == "stop"
    assert out.token_ids == full[: full.index(stop_id) + 1]


def test_seed_reproducible_whatever_the_batch(engine, loaded):
    vocab = loaded.config.vocab_size
    p = _prompt(6, 4, vocab)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = engine.generate([p], sp)[0].token_ids
    others = [_prompt(n, 10 + n, vocab) for n in (3, 11, 20)]
    mixed = engine.generate(
        [others[0], p, others[1], others[2]],
        [SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True), sp,
         SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=3, temperature=1.3, seed=5, ignore_eos=True)],
    )[1].token_ids
    assert mixed == alone
    other_seed = engine.generate([p], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99,
                                                     ignore_eos=True))[0].token_ids
    assert other_seed != alone


def test_logprobs_match_reference(engine, loaded, tiny_llama_dir):
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    p = _prompt(10, 5, loaded.config.vocab_size)
    (out,) = engine.generate([p], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True))
    ref = hf_greedy(hf, p, 6, loaded.tokenizer.vocab_size)
    assert out.token_ids == ref.token_ids
    expected = [float(torch.log_softmax(lg, -1)[t]) for lg, t in zip(ref.logits, ref.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-4)


def test_abort_frees_blocks(engine, loaded):
    vocab = loaded.config.vocab_size
    sp = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    ids = [engine.add_request(_prompt(n, n, vocab), sp) for n in (5, 13, 30)]
    for _ in range(3):
        engine.step()
    used = engine.pool.num_blocks - engine.pool.num_free_blocks
    assert used > 0
    assert engine.abort(ids[1]) is True
    assert engine.abort(ids[1]) is False
    assert engine.pool.num_blocks - engine.pool.num_free_blocks < used
    engine.scheduler.check_integrity()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert set(done) == {ids[0], ids[2]}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.scheduler.check_integrity()


def test_long_prompt_chunked_with_short_ones(loaded):
    """A prompt longer than the token budget is split across passes while short prompts keep decoding."""
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                                    max_num_batched_tokens=16), loaded=loaded)
    vocab = loaded.config.vocab_size
    short = engine.add_request(_prompt(3, 1, vocab), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request(_prompt(100, 2, vocab), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    short_tokens_while_long_prefills = 0
    for _ in range(6):  # the 100-token prompt needs 7 passes of at most 16 tokens
        out = engine.scheduler.running and engine.step()
        short_tokens_while_long_prefills += sum(len(o.token_ids) for o in out if o.request_id == short)
    assert short_tokens_while_long_prefills >= 5


@pytest.mark.parametrize("chunked", [True, False])
def test_short_prompt_behind_a_long_one(loaded, chunked):
    """Chunked prefill: the short prompt shares the long one's first pass and gets its token at once.
    Unchunked: the long prompt fills a pass of its own (over the budget) and the short one waits."""
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                                    max_num_batched_tokens=64, enable_chunked_prefill=chunked, prefill_chunk=16,
                                    prefill_order="arrival"),
                       loaded=loaded)
    vocab = loaded.config.vocab_size
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    long = engine.add_request(_prompt(100, 2, vocab), greedy)
    short = engine.add_request(_prompt(5, 1, vocab), greedy)
    plan = engine.scheduler.schedule()
    sizes = {s.seq.request_id: s.num_tokens for s in plan.scheduled}
    assert sizes == ({long: 16, short: 5} if chunked else {long: 100})
    engine.scheduler.update(plan, [0] * sum(s.sample for s in plan.scheduled))  # bookkeeping only
    for rid in (long, short):
        engine.abort(rid)
    engine.scheduler.check_integrity()


def test_chunked_and_unchunked_prefill_give_the_same_tokens(loaded):
    vocab = loaded.config.vocab_size
    prompts = [_prompt(n, n, vocab) for n in (90, 7, 41)]
    results = []
    for chunked in (True, False):
        engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                                        max_num_batched_tokens=32, enable_chunked_prefill=chunked,
                                        enable_prefix_caching=False), loaded=loaded)
        outs = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        results.append([o.token_ids for o in outs])
    assert results[0] == results[1]


@pytest.mark.parametrize("prompt,field", [
    ([], "prompt"),
    ([1] * 5000, "prompt"),
    ([10**6], "prompt_token_ids"),
    ([-1], "prompt_token_ids"),
])
def test_bad_requests_name_the_field(engine, prompt, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(prompt, SamplingParams())
    assert e.value.field == field
    assert engine.num_requests == 0


def test_duplicate_request_id(engine):
    engine.add_request([1, 2], SamplingParams(), request_id="a")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request([1, 2], SamplingParams(), request_id="a")


def test_interactive_requests_are_admitted_before_waiting_batch_ones(loaded):
    from baton.api import Priority

    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4,
                                    max_num_seqs=1), loaded=loaded)
    vocab = loaded.config.vocab_size
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request(_prompt(6, 1, vocab), params, request_id="b1", priority=Priority.BATCH)
    engine.add_request(_prompt(6, 2, vocab), params, request_id="b2", priority=Priority.BATCH)
    finished = [o.request_id for o in engine.step() if o.finished]  # b1 is admitted (the only slot)
    engine.add_request(_prompt(6, 3, vocab), params, request_id="i1", priority=Priority.INTERACTIVE)
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b1", "i1", "b2"]  # b1 was already running; i1 jumps ahead of b2


def test_batch_requests_are_preempted_before_interactive_ones(loaded):
    from baton.api import Priority

    vocab = loaded.config.vocab_size
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = {"i-old": _prompt(8, 1, vocab), "b": _prompt(8, 2, vocab), "i-new": _prompt(8, 3, vocab)}
    alone = {}
    for rid, p in prompts.items():
        e = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=4 << 20, block_size=4),
                      loaded=loaded)
        alone[rid] = e.generate([p], params)[0].token_ids
    per_block = 2 * loaded.config.num_layers * 4 * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    # Room for about 20 blocks: three sequences of 8 + 24 tokens (8 blocks each) cannot all fit.
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=20 * per_block, block_size=4,
                                    enable_prefix_caching=False), loaded=loaded)
    prio = {"i-old": Priority.INTERACTIVE, "b": Priority.BATCH, "i-new": Priority.INTERACTIVE}
    for rid, p in prompts.items():
        engine.add_request(p, params, request_id=rid, priority=prio[rid])
    preempted, out = [], {rid: [] for rid in prompts}
    while engine.has_unfinished():
        before = {s.request_id: s.num_preemptions for s in engine.scheduler.running + list(engine.scheduler.waiting)}
        for o in engine.step():
            out[o.request_id] += o.token_ids
        after = {s.request_id: s.num_preemptions for s in engine.scheduler.running + list(engine.scheduler.waiting)}
        preempted += [rid for rid, n in after.items() if n > before.get(rid, 0)]
    assert preempted and set(preempted) == {"b"}  # never an interactive one, though "i-new" is newer
    assert out == alone  # preemption (recompute) changes no token

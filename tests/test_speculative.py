"""Speculative decoding: the n-gram proposer, the controller that decides how far to speculate, the scheduler's
drafts, and the engine's output with speculation on, which must be what it is with speculation off (greedy and
seeded, batched, prefix-cached, preempted, across the hand-off, with stops inside an accepted run) on the
default model; sampled continuations follow the target distribution (chi-square)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from baton.api import SamplingParams
from baton.config import EngineConfig
from baton.engine.block_pool import BlockPool
from baton.engine.engine import LLMEngine
from baton.engine.sampling import SamplingState
from baton.engine.scheduler import Scheduler, SchedulerConfig
from baton.engine.sequence import Sequence
from baton.engine.speculative import NgramIndex, SpecController, SpecState, Speculator

# -- the n-gram proposer ------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_match():
    idx = NgramIndex(2, 3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurred at the start, followed by 4 5 9; (2, 3) alone last ended before 7 8
    assert idx.propose(tokens, 3) == [4, 5, 9]
    assert idx.propose(tokens + [7], 2) == [8, 1]  # (2, 3, 7) matches; grows incrementally
    assert idx.propose([5, 6, 7], 4) == []  # no earlier occurrence of any suffix


def test_ngram_never_matches_the_suffix_itself():
    idx = NgramIndex(2, 2)
    assert idx.propose([1, 2], 4) == []
    assert idx.propose([1, 2, 1, 2], 4) == [1, 2]  # the (1, 2) that ended at index 2, then what followed


# -- the controller -----------------------------------------------------------------------------------------


def _seqs(n: int, accept: float) -> list[Sequence]:
    out = []
    for i in range(n):
        ids = [1, 2, 3]
        s = Sequence(f"r{i}", ids, 3, SamplingState(SamplingParams(max_tokens=64), ids), 0.0)
        s.spec = SpecState(accept=accept)
        out.append(s)
    return out


def test_controller_measures_a_plain_pass_before_it_speculates():
    c = SpecController(4)
    seqs = _seqs(1, 0.9)
    assert c.widths(seqs, [4], 1) == [0]
    c.record(1, 0.020)
    assert c.widths(seqs, [4], 1) == [4], "one row is memory-bound: 4 more rows cost ~12%"


def test_controller_backs_off_when_rows_cost_their_compute():
    """At a large batch each row costs its full share of the pass: a proposal kept with probability a < 1 is
    worth less than the row it takes, so the controller proposes nothing."""
    c = SpecController(4)
    for rows in (16, 32, 48, 80):
        c.record(rows, 0.002 * rows)  # linear: compute-bound
    assert c.widths(_seqs(16, 0.8), [4] * 16, 16) == [0] * 16


def test_controller_follows_the_measured_acceptance():
    c = SpecController(4)
    for rows, t in ((1, 0.020), (2, 0.021), (3, 0.022), (5, 0.040)):
        c.record(rows, t)  # cheap to 3 rows, then a step
    assert c.widths(_seqs(1, 0.9), [4], 1) == [2], "2 rows ride almost free; 4 cost more than they give"
    assert c.widths(_seqs(1, 0.02), [4], 1) == [0], "rarely kept: not worth even a cheap row"


def test_learned_acceptance_moves_toward_what_was_kept():
    s = _seqs(1, 0.6)[0]
    SpecController.learn(s, 4, 0)
    low = s.spec.accept
    assert low < 0.6
    SpecController.learn(s, 4, 4)
    assert s.spec.accept > low


# -- drafts in the scheduler --------------------------------------------------------------------------------


def _decoding(blocks: int, budget: int = 256) -> tuple[Scheduler, Sequence]:
    s = Scheduler(SchedulerConfig(max_model_len=4096, enable_prefix_caching=False), BlockPool(blocks, 4))
    ids = list(range(7))
    seq = Sequence("a", ids, 7, SamplingState(SamplingParams(max_tokens=32, ignore_eos=True), ids), 0.0)
    s.add(seq)
    out = s.schedule()
    s.update(out, [9])  # prefilled: 8 tokens, 7 computed, 2 blocks
    s.config = dataclasses.replace(s.config, max_num_batched_tokens=budget)
    return s, seq


def test_a_draft_reserves_its_blocks_and_is_trimmed_to_the_budget():
    s, seq = _decoding(blocks=8, budget=3)
    out = s.with_drafts(s.schedule(), {seq: [1, 2, 3, 4]})
    (d,) = out.decodes
    assert d.draft == (1, 2) and d.num_tokens == 3, "the budget of 3 takes the token and two proposals"
    assert len(seq.block_ids) == 3  # positions 7..9: a third block
    s.check_integrity()


def test_a_draft_without_blocks_is_dropped_never_preempting():
    s, seq = _decoding(blocks=2)
    out = s.with_drafts(s.schedule(), {seq: [1, 2, 3, 4, 5]})
    (d,) = out.decodes
    assert d.draft == () and d.num_tokens == 1 and not out.preempted
    assert s.num_preemptions == 0


def test_a_pass_within_the_same_bits_rows_stays_within_them():
    s, seq = _decoding(blocks=8)
    out = s.with_drafts(s.schedule(), {seq: [1, 2, 3, 4, 5, 6]}, same_bits_rows=4)
    assert out.decodes[0].num_tokens == 4


def test_accepted_drafts_count_as_computed_and_a_stop_ends_the_run():
    s, seq = _decoding(blocks=8)
    out = s.with_drafts(s.schedule(), {seq: [1, 2, 3]})
    for t in (1, 2, 5):  # 1 and 2 match the draft, 5 does not: two accepted, three tokens
        assert s.accept(seq, t)
    s.finish_pass(out, [2])
    assert seq.token_ids[7:] == [9, 1, 2, 5] and seq.num_computed_tokens == 10
    s.check_integrity()


# -- the engine on the default model ------------------------------------------------------------------------

SHARED = ("You are a careful editor. Copy the user's text back exactly, then stop. Do not add anything, "
          "do not explain, keep every word and every line as it is.\n\n")
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.",
    "Roses are red, violets are blue, sugar is sweet, and so are you.",
    "for i in range(10):\n    print(i * i)\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "SELECT name, age FROM users WHERE age > 30 ORDER BY name;",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "Water boils at 100 degrees Celsius at sea level.",
    "import os\nprint(os.getcwd())\n",
    "The meeting is on Monday at nine. Please bring the report.",
    "a = [1, 2, 3]\nb = [x * 2 for x in a]\n",
    "Light travels faster than sound, which is why we see lightning first.",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.",
    "The cat sat on the mat, and the dog sat on the log.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _engine(loaded, on: bool, **kw) -> LLMEngine:
    kw.setdefault("speculative", "ngram" if on else "off")
    kw.setdefault("spec_tokens", 4)
    config = EngineConfig(dtype="float32", device="cpu", kv_cache_memory=kw.pop("kv_cache_memory", 64 << 20),
                          block_size=16, **kw)
    engine = LLMEngine(config, loaded=loaded)
    if engine.speculator is not None:
        engine.speculator.adaptive = False  # every proposal, every pass: exactness must not hang on the controller
    return engine


@pytest.fixture(scope="module")
def prompts(default_model):
    tok = default_model.tokenizer
    return [tok.encode_chat([{"role": "user", "content": SHARED + t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def reference(default_model, prompts):
    """Each prompt's greedy answer without speculation, one at a time."""
    engine = _engine(default_model, False, enable_prefix_caching=False)
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_greedy_one_at_a_time_is_unchanged(default_model, prompts, reference):
    engine = _engine(default_model, True, enable_prefix_caching=False)
    for i, p in enumerate(prompts):
        assert engine.generate([p], GREEDY)[0].token_ids == reference[i], f"prompt {i}"
    stats = engine.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens, \
        "the test needs both kept and rejected proposals"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_greedy_batched_with_a_shared_cached_prefix_is_unchanged(default_model, prompts, reference):
    engine = _engine(default_model, True)
    engine.generate([prompts[0]], GREEDY)  # caches the shared prefix
    outs = engine.generate(prompts, GREEDY)
    assert all(o.cached_prompt_tokens >= 32 for o in outs[1:]), [o.cached_prompt_tokens for o in outs]
    for i, o in enumerate(outs):
        assert o.token_ids == reference[i], f"prompt {i}"
    assert engine.speculator.stats.num_accepted_tokens > 0
    engine.scheduler.check_integrity()


def test_greedy_under_preemption_is_unchanged(default_model, prompts, reference):
    mc = default_model.config
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    engine = _engine(default_model, True, kv_cache_memory=24 * per_block, enable_prefix_caching=False)
    outs = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small for all 16"
    for i, o in enumerate(outs):
        assert o.token_ids == reference[i], f"prompt {i}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], params: SamplingParams) -> list[int]:
    """What a prefill and a decode worker do with one request: export the prompt's KV, then decode after it."""
    rid = prefill.add_request(prompt, dataclasses.replace(params, max_tokens=1), export_kv=True)
    (out,) = [o for o in prefill.step() if o.request_id == rid]
    decode.add_prefilled(prompt, out.token_ids[0], params, decode.reserve_blocks(len(prompt)), out.kv,
                         sampler_state=out.sampler_state)
    tokens = []
    while decode.has_unfinished():
        for o in decode.step():
            tokens += o.token_ids
    return tokens


def test_greedy_across_the_hand_off_is_unchanged(default_model, prompts, reference):
    """A prefill engine without speculation exports the KV; a decode engine with it goes on."""
    prefill = _engine(default_model, False)
    decode = _engine(default_model, True)
    for i in (0, 3, 7, 12):
        assert _handoff(prefill, decode, prompts[i], GREEDY) == reference[i], f"prompt {i}"
    assert decode.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_is_unchanged_and_repeats(default_model, prompts):
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    off = [o.token_ids for o in _engine(default_model, False).generate(prompts, params)]
    on = _engine(default_model, True)
    assert [o.token_ids for o in on.generate(prompts, params)] == off
    assert [o.token_ids for o in on.generate(prompts, params)] == off
    assert on.speculator.stats.num_accepted_tokens > 0


def test_a_request_can_opt_out(default_model, prompts):
    engine = _engine(default_model, True)
    out, = engine.generate([prompts[1]], dataclasses.replace(GREEDY, no_speculation=True))
    assert out.spec_drafts == 0 and engine.speculator.stats.num_drafts == 0
    out, = engine.generate([prompts[1]], GREEDY)
    assert out.spec_drafts > 0 and out.spec_accepted_tokens > 0


# -- stops inside an accepted run ---------------------------------------------------------------------------


class FixedDraft(Speculator):
    """Proposes, for every decode, the given continuation from where the sequence stands (a perfect draft when
    it is the reference answer), or a fixed list."""

    def __init__(self, answers: dict[int, list[int]] | None = None, fixed: list[int] | None = None, k: int = 6):
        super().__init__("ngram", k, 2, 4, adaptive=False)
        self.answers, self.fixed = answers or {}, fixed

    def propose(self, decodes, reserve=None):
        out = {}
        for s in decodes:
            if self.fixed is not None:
                out[s] = list(self.fixed)
                continue
            answer = self.answers[s.num_prompt_tokens]
            n = s.num_output_tokens
            out[s] = answer[n:n + self.k]
        for s in out:
            if s.spec is None:
                s.spec = SpecState()
        return out


def _stream(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request(prompt, params)
    tokens, text, reason = [], "", None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            tokens += o.token_ids
            text += o.text
            if o.finished:
                reason = o.finish_reason
    return tokens, text, reason


@pytest.mark.parametrize("stop", ["token", "string", "max_tokens", "eos"])
def test_a_stop_inside_an_accepted_run_ends_at_its_token(default_model, prompts, reference, stop):
    prompt, answer = prompts[1], reference[1]
    tok = default_model.tokenizer
    params = GREEDY
    at = 9  # the answer's 10th token ends it; the draft covers it with tokens to spare on both sides
    if stop == "token":
        params = dataclasses.replace(GREEDY, stop_token_ids=(answer[at],))
        at = answer.index(answer[at])
    elif stop == "string":
        piece = tok.decode(answer[at:at + 1]).strip() or tok.decode(answer[at:at + 1])
        params = dataclasses.replace(GREEDY, stop=(piece,))
    elif stop == "max_tokens":
        params = dataclasses.replace(GREEDY, max_tokens=at + 1)
    off = _engine(default_model, False)
    on = _engine(default_model, True)
    for e in (off, on):
        if stop == "eos":
            e.scheduler.config = dataclasses.replace(e.scheduler.config, eos_token_ids=frozenset({answer[at]}))
            params = dataclasses.replace(GREEDY, ignore_eos=False)
    on.speculator = FixedDraft({len(prompt): answer + [0] * 8})
    want = _stream(off, prompt, params)
    got = _stream(on, prompt, params)
    assert got == want
    assert on.speculator.stats.num_accepted_tokens >= len(want[0]) - 2, "the stop was inside an accepted run"
    if stop != "string":
        assert len(want[0]) == at + 1 or (stop == "token" and want[0][-1] == answer[at])
    else:
        assert want[2] == "stop" and len(want[0]) <= at + 1
    assert on.pool.num_free_blocks == on.pool.num_blocks


# -- the target distribution --------------------------------------------------------------------------------


def _chi_square_p(observed: list[int], expected: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_speculative_sampling_keeps_the_target_distribution(default_model, prompts):
    """3-token continuations sampled with a fixed draft (often right, often wrong) against their exact
    probabilities from the model: a chi-square over the likely triples and the rest."""
    prompt = prompts[2]
    temperature, top_k, n = 1.0, 3, 1000
    off = _engine(default_model, False)

    def dist(context: list[int]) -> torch.Tensor:
        out = off.generate([context], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=top_k,
                                                     ignore_eos=True))[0]
        top = out.top_logprobs[0]
        ids = torch.tensor(top.token_ids[:top_k])
        p = torch.tensor(top.logprobs[:top_k], dtype=torch.float64).exp()
        return ids, p / p.sum()

    # exact probabilities of every triple (3 x 3 x 3 branches)
    exact: dict[tuple[int, ...], float] = {}
    ids1, p1 = dist(prompt)
    for a, pa in zip(ids1.tolist(), p1.tolist()):
        ids2, p2 = dist(prompt + [a])
        for b, pb in zip(ids2.tolist(), p2.tolist()):
            ids3, p3 = dist(prompt + [a, b])
            for c, pc in zip(ids3.tolist(), p3.tolist()):
                exact[(a, b, c)] = pa * pb * pc
    likely = sorted(exact, key=lambda t: -exact[t])
    # the draft proposes the most likely second and third tokens after the most likely first: kept often,
    # rejected often
    on = _engine(default_model, True)
    on.speculator = FixedDraft(fixed=list(likely[0][1:]), k=2)
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=i, ignore_eos=True)
              for i in range(n)]
    counts: dict[tuple[int, ...], int] = {}
    for o in on.generate([prompt] * n, params):
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    st = on.speculator.stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert set(counts) <= set(exact), "a triple outside the top-3 branches"
    bins = [t for t in likely if exact[t] * n >= 5]
    observed = [counts.get(t, 0) for t in bins]
    expected = [exact[t] * n for t in bins]
    rest = n - sum(observed), n - sum(expected)
    if rest[1] >= 5:
        observed.append(rest[0])
        expected.append(rest[1])
    p = _chi_square_p(observed, expected)
    assert p > 1e-3, (p, list(zip(observed, expected)))
    assert math.isclose(sum(expected), n, rel_tol=1e-6) or rest[1] < 5


# -- a draft model ------------------------------------------------------------------------------------------


def _truncated_gguf(src: str, dst, layers: int):
    """The default model's file with only its first ``layers`` blocks: a small draft with the same tokenizer."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = layers if name == f"{arch}.block_count" else f.contents()
        writer.add_key_value(name, value, f.types[0], f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


@pytest.fixture(scope="module")
def small_draft(default_model_path, tmp_path_factory):
    return str(_truncated_gguf(default_model_path, tmp_path_factory.mktemp("draft") / "draft.gguf", 4))


def _draft_engine(loaded, draft: str, **kw) -> LLMEngine:
    return _engine(loaded, True, speculative="draft", spec_draft_model=draft, **kw)


def test_a_small_draft_model_keeps_greedy_output(default_model, prompts, reference, small_draft):
    engine = _draft_engine(default_model, small_draft)
    outs = engine.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.speculator.stats.num_draft_tokens > 0
    prefill = _engine(default_model, False)
    for i in (2, 9):
        assert _handoff(prefill, engine, prompts[i], GREEDY) == reference[i], f"prompt {i}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_the_draft_computes_its_own_kv_on_the_decode_side(default_model, default_model_path, prompts, reference):
    """The target as its own draft: every proposal is the target's greedy token only if the draft's KV of the
    prompt and of every kept token is right: after the hand-off (the draft computes the prompt's KV on the
    decode side) and after preemptions (it computes it again)."""
    mc = default_model.config
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * mc.head_dim * 4
    engine = _draft_engine(default_model, default_model_path, kv_cache_memory=24 * per_block,
                           enable_prefix_caching=False)
    assert engine.speculator.draft.runner.kv_cache.dtype == engine.kv_cache.dtype  # kv_dtype auto's rule for both
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
    assert engine.scheduler.num_preemptions > 0
    prefill = _engine(default_model, False)
    for i in (4, 11):
        assert _handoff(prefill, engine, prompts[i], GREEDY) == reference[i], f"prompt {i}"
    st = engine.speculator.stats
    assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens, st


def test_a_draft_with_another_tokenizer_is_refused(default_model, tiny_llama_dir):
    from baton.config import ConfigError

    with pytest.raises(ConfigError, match="tokenizer is not the target's"):
        _draft_engine(default_model, str(tiny_llama_dir))


# -- what a client and baton bench see ----------------------------------------------------------------------


def test_usage_and_bench_report_the_counts(default_model, prompts):
    """A finished request's counts reach the gRPC usage, and baton bench's mean accepted length and acceptance
    are computed from them."""
    from baton.bench.report import SLO, RequestRecord, summarize, table
    from baton.services.worker import response_from_output

    engine = _engine(default_model, True)
    out, = engine.generate([prompts[3]], GREEDY)
    usage = response_from_output(out).usage
    assert (usage.spec_drafts, usage.spec_draft_tokens, usage.spec_accepted_tokens) == (
        out.spec_drafts, out.spec_draft_tokens, out.spec_accepted_tokens)
    assert 0 < usage.spec_accepted_tokens <= usage.spec_draft_tokens
    records = [RequestRecord("a", "edit", 0.0, output_tokens=10, token_times=[0.1, 0.2], done=0.3, spec_drafts=4,
                             spec_draft_tokens=12, spec_accepted_tokens=6),
               RequestRecord("b", "edit", 0.0, output_tokens=10, token_times=[0.1], done=0.2)]
    stats = summarize(records, 1.0, SLO(), None)
    assert stats["spec_mean_accepted_length"] == 1 + 6 / 4 and stats["spec_acceptance"] == 0.5
    assert "spec len" in table([{"label": "1 client", "stats": stats}])

"""Tests for baton.engine.sampling: parameter validation, the logits pipeline, seeding, penalties."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from baton.api import InvalidRequestError, SamplingParams
from baton.engine.sampling import Sampler, SamplingState, apply_penalties
from baton.kernels import cpu as cpu_kernels

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make_state(device: str = "cpu", prompt: list[int] | None = None, **kwargs: object) -> SamplingState:
    return SamplingState.create(SamplingParams(**kwargs), prompt if prompt is not None else [0], device)


class FunctionRecorder(TorchFunctionMode):
    """Records the name of every torch function / tensor method called while active; the sampler's C
    argmax (CPU) is recorded as one "argmax", what it does inside not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._argmax = cpu_kernels.argmax_rows

    def __enter__(self):  # type: ignore[no-untyped-def]
        def counted(x: torch.Tensor) -> torch.Tensor:
            self.calls.append("argmax")
            with torch.overrides._pop_mode_temporarily():
                return self._argmax(x)

        cpu_kernels.argmax_rows = counted
        return super().__enter__()

    def __exit__(self, *exc):  # type: ignore[no-untyped-def]
        cpu_kernels.argmax_rows = self._argmax
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


# -- validation ------------------------------------------------------------------------------------------

BAD_VALUES = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", True),
    ("max_tokens", 1.5),
    ("max_tokens", "16"),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_k", -1),
    ("top_k", 2.0),
    ("top_k", False),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.0),
    ("seed", True),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", 5),
    ("stop", {"a"}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 7),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", math.inf),
    ("logprobs", 1),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES)
def test_invalid_field_is_rejected_and_named(name: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{name: value})
    assert info.value.field == name
    assert str(info.value).startswith(name)
    assert isinstance(info.value, ValueError)


def test_temperature_message_says_what_is_accepted() -> None:
    with pytest.raises(InvalidRequestError, match=r"temperature must be >= 0.0, got -1.0"):
        SamplingParams(temperature=-1.0)


def test_valid_params_are_normalized() -> None:
    params = SamplingParams(
        max_tokens=5,
        temperature=1,
        top_p=1,
        top_k=3,
        seed=2**64 - 1,
        stop=["a", "bc"],
        stop_token_ids=[7, 8],
        presence_penalty=-2,
        frequency_penalty=2,
    )
    assert params.stop == ("a", "bc")
    assert params.stop_token_ids == (7, 8)
    assert isinstance(params.temperature, float) and params.temperature == 1.0
    assert isinstance(params.top_p, float)
    assert isinstance(params.presence_penalty, float)
    assert hash(params) == hash(SamplingParams(**{**params.__dict__}))
    assert SamplingParams(stop="###").stop == ("###",)


def test_greedy_and_generator() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-9).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert make_state(temperature=0.0).generator is None
    assert make_state(temperature=0.7).generator is not None


# -- greedy ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(device: str, dtype: torch.dtype) -> None:
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    states = [make_state(device, temperature=0.0) for _ in range(8)]
    out = Sampler()(logits, states)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_all_greedy_batch_is_one_argmax() -> None:
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1))
    states = [make_state(temperature=0.0) for _ in range(64)]
    with FunctionRecorder() as recorder:
        out = Sampler()(logits, states)
    assert recorder.calls.count("argmax") == 1
    # No per-row work: a per-row loop would show up as dozens of tensor calls.
    assert len(recorder.calls) < 10, recorder.calls
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_rows_need_one_draw_each_and_one_argmax() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(2))
    states = [make_state(temperature=0.0) for _ in range(12)] + [make_state(seed=i) for i in range(4)]
    with FunctionRecorder() as recorder:
        Sampler()(logits, states)
    assert recorder.calls.count("exponential_") == 4
    # One over every row: the greedy rows' logits beside the sampled rows' probs / noise.
    assert recorder.calls.count("argmax") == 1


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_one_and_tiny_top_p_equal_greedy(device: str) -> None:
    logits = torch.randn(10, 500, generator=torch.Generator().manual_seed(3)).to(device)
    expected = logits.argmax(dim=-1).tolist()
    for options in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        states = [make_state(device, temperature=1.5, seed=seed, **options) for seed in range(10)]
        assert Sampler()(logits, states).token_ids == expected, options


def test_ties_top_k_one_picks_lowest_id_like_argmax() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0, 5.0]])
    for seed in range(20):
        assert Sampler()(logits, [make_state(top_k=1, seed=seed)]).token_ids == [1]
        assert Sampler()(logits, [make_state(top_p=1e-3, seed=seed)]).token_ids == [1]


# -- filtering and distributions -------------------------------------------------------------------------


def draw(logits_row: torch.Tensor, count: int, **kwargs: object) -> Counter[int]:
    """Samples ``count`` times from one row of logits, each draw a differently seeded request."""
    logits = logits_row[None, :].expand(count, -1)
    states = [make_state(seed=seed, **kwargs) for seed in range(count)]
    return Counter(Sampler()(logits, states).token_ids)


def test_min_p_masks_unlikely_tokens() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = probs.log()
    counts = draw(logits, 1500, min_p=0.3)  # threshold 0.3 * 0.4 = 0.12: tokens 3 and 4 are masked
    assert set(counts) == {0, 1, 2}
    # The survivors keep their relative odds: p0/p2 = 0.4/0.15.
    assert 1.8 < counts[0] / counts[2] < 3.8


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    counts = draw(logits, 1000, top_p=0.7)  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep tokens 0 and 1
    assert set(counts) == {0, 1}
    assert 1.1 < counts[0] / counts[1] < 2.4  # renormalized 0.625 : 0.375
    counts = draw(logits, 1000, top_p=0.8)  # exactly reaches 0.8 with two tokens (float rounding aside)
    assert counts[3] == 0


def test_top_k_keeps_k_best() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0, 2.5])
    counts = draw(logits, 1000, top_k=2)
    assert set(counts) == {1, 4}


def chi_square(counts: Counter[int], probs: torch.Tensor, total: int) -> float:
    return sum((counts[i] - total * p) ** 2 / (total * p) for i, p in enumerate(probs.tolist()))


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_sampling_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5])
    total = 4000
    counts = draw(logits, total, temperature=temperature)
    expected = torch.softmax(logits / temperature, dim=-1)
    # 4 degrees of freedom: P(chi2 > 25) is about 5e-5; the seeds are fixed, so this is deterministic.
    assert chi_square(counts, expected, total) < 25.0
    # And a wrong temperature is rejected by the same test (it can tell the distributions apart).
    wrong = torch.softmax(logits / (temperature * 2), dim=-1)
    assert chi_square(counts, wrong, total) > 25.0


def test_combined_filters_order() -> None:
    # top-k 3 keeps {0, 1, 2}; top-p 0.6 of the renormalized (0.5, 0.3, 0.2) keeps {0, 1};
    # min-p 0.7 of max 0.625 cuts token 1 (0.375).
    logits = torch.tensor([0.40, 0.24, 0.16, 0.12, 0.08]).log()
    assert set(draw(logits, 300, top_k=3)) == {0, 1, 2}
    assert set(draw(logits, 300, top_k=3, top_p=0.6)) == {0, 1}
    assert set(draw(logits, 300, top_k=3, top_p=0.6, min_p=0.7)) == {0}


# -- seeding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_same_tokens_whatever_the_batch(device: str) -> None:
    vocab, steps = 200, 12
    row_logits = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(steps)]
    params = {"seed": 1234, "temperature": 0.9, "top_p": 0.95, "top_k": 50, "presence_penalty": 0.5}

    def run(others_before: int, others_after: int) -> list[int]:
        tracked = make_state(device, prompt=[1, 2, 3], **params)
        before = [make_state(device, seed=7 + i, temperature=1.3) for i in range(others_before)]
        after = [make_state(device, temperature=0.0) for _ in range(others_after)]
        sampler = Sampler()
        gen = torch.Generator().manual_seed(others_before * 10 + others_after)
        tokens = []
        for step in range(steps):
            states = before + [tracked] + after
            logits = torch.randn(len(states), vocab, generator=gen)
            logits[others_before] = row_logits[step]
            out = sampler(logits.to(device), states)
            tokens.append(out.token_ids[others_before])
            for state, token in zip(states, out.token_ids, strict=True):
                state.output_token_ids.append(token)
        return tokens

    alone = run(0, 0)
    assert run(3, 0) == alone
    assert run(0, 5) == alone
    assert run(2, 2) == alone


def test_different_seeds_differ_and_unseeded_requests_differ() -> None:
    vocab, steps = 1000, 20
    logits = torch.zeros(1, vocab)

    def tokens(state: SamplingState) -> list[int]:
        return [Sampler()(logits, [state]).token_ids[0] for _ in range(steps)]

    assert tokens(make_state(seed=1)) == tokens(make_state(seed=1))
    assert tokens(make_state(seed=1)) != tokens(make_state(seed=2))
    assert tokens(make_state()) != tokens(make_state())


def test_sampled_state_without_generator_is_an_error() -> None:
    state = SamplingState(params=SamplingParams(temperature=1.0), prompt_token_ids=[1])
    with pytest.raises(ValueError, match="SamplingState.create"):
        Sampler()(torch.zeros(1, 10), [state])


def test_bad_logits_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[batch, vocab\]"):
        Sampler()(torch.zeros(10), [make_state()])
    with pytest.raises(ValueError, match="2 sampling states for 3 rows"):
        Sampler()(torch.zeros(3, 10), [make_state(), make_state()])
    assert Sampler()(torch.zeros(0, 10), []).token_ids == []


# -- penalties -------------------------------------------------------------------------------------------

LOGITS = [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]
PROMPT = [0, 1]
OUTPUT = [3, 3, 4]


def penalized(**kwargs: object) -> list[float]:
    state = make_state(prompt=PROMPT, **kwargs)
    state.output_token_ids.extend(OUTPUT)
    return apply_penalties(torch.tensor([LOGITS]), [state])[0].tolist()


def test_repetition_penalty_formula() -> None:
    # Seen (prompt or output): 0, 1, 3, 4. Positive logits are divided by 2, negative ones multiplied.
    assert penalized(repetition_penalty=2.0) == [1.0, -2.0, 0.5, 1.5, -4.0, 0.0]
    assert penalized(repetition_penalty=0.5) == [4.0, -0.5, 0.5, 6.0, -1.0, 0.0]


def test_presence_and_frequency_penalty_formula() -> None:
    # Output counts: token 3 twice, token 4 once; prompt tokens are not counted.
    assert penalized(presence_penalty=0.5) == [2.0, -1.0, 0.5, 2.5, -2.5, 0.0]
    assert penalized(frequency_penalty=0.25) == [2.0, -1.0, 0.5, 2.5, -2.25, 0.0]
    assert penalized(presence_penalty=0.5, frequency_penalty=-1.0) == [2.0, -1.0, 0.5, 4.5, -1.5, 0.0]


def test_penalties_compose_repetition_first() -> None:
    # token 3: 3.0 / 2 = 1.5, then - 1.0 (presence) - 2 * 0.5 (frequency) = -0.5
    # token 4: -2.0 * 2 = -4.0, then - 1.0 - 0.5 = -5.5
    result = penalized(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    assert result == [1.0, -2.0, 0.5, -0.5, -5.5, 0.0]


def test_penalties_leave_other_rows_and_input_alone() -> None:
    logits = torch.tensor([LOGITS, LOGITS])
    before = logits.clone()
    penalized_state = make_state(prompt=PROMPT, repetition_penalty=2.0)
    plain_state = make_state(prompt=PROMPT)
    out = apply_penalties(logits, [plain_state, penalized_state])
    assert torch.equal(logits, before)
    assert out[0].tolist() == LOGITS
    assert out[1].tolist() == [1.0, -2.0, 0.5, 3.0, -2.0, 0.0]
    assert apply_penalties(logits, [plain_state, plain_state]) is logits


def test_penalty_counts_follow_appended_tokens() -> None:
    state = make_state(prompt=[], frequency_penalty=1.0)
    logits = torch.zeros(1, 4)
    assert apply_penalties(logits, [state])[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    state.output_token_ids.append(2)
    assert apply_penalties(logits, [state])[0].tolist() == [0.0, 0.0, -1.0, 0.0]
    state.output_token_ids.extend([2, 1])
    assert apply_penalties(logits, [state])[0].tolist() == [0.0, -1.0, -2.0, 0.0]
    state.output_token_ids[:] = [3]  # shrunk: counts are rebuilt
    assert apply_penalties(logits, [state])[0].tolist() == [0.0, 0.0, 0.0, -1.0]


def test_out_of_vocab_token_in_history_is_an_error() -> None:
    state = make_state(prompt=[0, 9], repetition_penalty=1.2)
    with pytest.raises(ValueError, match="token id 9"):
        apply_penalties(torch.zeros(1, 5), [state])


def test_greedy_takes_argmax_of_penalized_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0]])
    state = make_state(prompt=[1], temperature=0.0, repetition_penalty=4.0)  # 2.0 -> 0.5 < 1.0
    assert Sampler()(logits, [state]).token_ids == [0]
    state = make_state(prompt=[], temperature=0.0, presence_penalty=2.0)
    state.output_token_ids.append(1)  # 2.0 - 2.0 = 0.0 < 1.0
    assert Sampler()(logits, [state]).token_ids == [0]


# -- logprobs and mixed batches --------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_log_softmax_at_chosen_ids(device: str) -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(5))
    logits = logits.to(device=device, dtype=torch.bfloat16)
    states = [
        make_state(device, temperature=0.0, logprobs=True),
        make_state(device, temperature=0.0),
        make_state(device, seed=3, temperature=0.5, top_k=5, logprobs=True),
        make_state(device, seed=4, temperature=2.0, repetition_penalty=1.5, logprobs=True),
        make_state(device, seed=5),
        make_state(device, temperature=0.0, presence_penalty=1.0, logprobs=True),
    ]
    for state in states:
        state.output_token_ids.extend([1, 2, 3])
    out = Sampler()(logits, states)
    reference = torch.log_softmax(logits.float(), dim=-1).cpu()
    for row, (token, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        if states[row].params.logprobs:
            assert logprob is not None
            assert logprob == pytest.approx(reference[row, token].item(), abs=1e-6)
        else:
            assert logprob is None


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_are_each_rows_most_likely_tokens(device: str) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7)).to(device)
    states = [make_state(device, temperature=0.0, logprobs=True, top_logprobs=3),
              make_state(device, temperature=0.0, logprobs=True),
              make_state(device, seed=2, temperature=1.0, logprobs=True, top_logprobs=20),
              make_state(device, temperature=0.0)]
    out = Sampler()(logits, states)
    reference = torch.log_softmax(logits.float(), dim=-1).cpu()
    assert out.top_logprobs[1] is None and out.top_logprobs[3] is None
    for row, k in ((0, 3), (2, 20)):
        top = out.top_logprobs[row]
        want = reference[row].topk(k)
        assert top.token_ids == want.indices.tolist()
        assert top.logprobs == pytest.approx(want.values.tolist(), abs=1e-6)
    assert out.top_logprobs[0].token_ids[0] == out.token_ids[0]  # greedy picks the most likely


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_greedy_and_sampled_batch(device: str) -> None:
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(6)).to(device)
    argmax = logits.argmax(dim=-1).tolist()
    states = [
        make_state(device, temperature=0.0),
        make_state(device, seed=11, temperature=1.0),
        make_state(device, temperature=0.0),
        make_state(device, seed=12, top_k=1),
        make_state(device, seed=13, temperature=0.8, top_p=0.9),
        make_state(device, temperature=0.0),
        make_state(device, seed=14, min_p=1.0),
    ]
    out = Sampler()(logits, states)
    for row in (0, 2, 3, 5, 6):
        assert out.token_ids[row] == argmax[row]
    # The free rows are reproducible alone, with the same seeds.
    alone_1 = Sampler()(logits[1:2], [make_state(device, seed=11, temperature=1.0)]).token_ids[0]
    alone_4 = Sampler()(logits[4:5], [make_state(device, seed=13, temperature=0.8, top_p=0.9)]).token_ids[0]
    assert (out.token_ids[1], out.token_ids[4]) == (alone_1, alone_4)
    assert all(0 <= token < 300 for token in out.token_ids)

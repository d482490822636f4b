"""The request layer on its own: proto <-> params derived from the fields, resolution, the stop rule."""

from __future__ import annotations

import dataclasses

import pytest

from baton.api import FinishReason, InvalidRequestError, SamplingParams, check_prompt_ids, check_stop
from baton.api.client import generate_request
from baton.api.params import Constraint
from baton.api.proto import resolved_sampling, sampling_from_proto, sampling_to_proto
from baton.v1 import generation_pb2 as pb

SET = SamplingParams(max_tokens=9, temperature=0.5, top_p=0.75, top_k=3, min_p=0.25, seed=7, stop=("x", "yz"),
                     stop_token_ids=(4, 5), ignore_eos=True, repetition_penalty=1.5, presence_penalty=-1.0,
                     frequency_penalty=0.5, logprobs=True, top_logprobs=2,
                     constraint=Constraint("regex", "[a-z]+"), no_speculation=True)


def test_every_field_is_in_the_proto_under_its_name():
    assert set(SamplingParams.field_names()) <= set(pb.SamplingParams.DESCRIPTOR.fields_by_name)


def test_every_field_round_trips_and_differs_from_its_default():
    # SET moves every field off its default, so a field the mapping dropped would show.
    for f in dataclasses.fields(SamplingParams):
        assert getattr(SET, f.name) != f.default, f.name
    assert sampling_from_proto(sampling_to_proto(SET)) == SET
    assert resolved_sampling(sampling_to_proto(SET)) == SET


def test_unset_fields_take_the_given_defaults_and_workers_refuse_unresolved_params():
    assert sampling_from_proto(pb.SamplingParams()) == SamplingParams()
    defaults = SamplingParams(max_tokens=3)
    assert sampling_from_proto(pb.SamplingParams(temperature=0), defaults) == SamplingParams(max_tokens=3,
                                                                                              temperature=0)
    with pytest.raises(InvalidRequestError) as e:
        resolved_sampling(pb.SamplingParams(temperature=0))
    assert "not resolved by the router" in str(e.value)
    assert resolved_sampling(sampling_to_proto(SamplingParams())).seed is None  # None is a resolved value


def test_invalid_values_name_their_field():
    with pytest.raises(InvalidRequestError) as e:
        sampling_from_proto(pb.SamplingParams(top_p=1.5))
    assert e.value.field == "top_p" and e.value.detail("sampling.").startswith("sampling.top_p")


def test_stop_rule():
    p = SamplingParams(max_tokens=2, stop_token_ids=(9,))
    assert check_stop(p, 9, 1, 10, 100, {2}) is FinishReason.STOP
    assert check_stop(p, 2, 1, 10, 100, {2}) is FinishReason.STOP
    assert check_stop(dataclasses.replace(p, ignore_eos=True), 2, 1, 10, 100, {2}) is None
    assert check_stop(p, 3, 2, 10, 100, {2}) is FinishReason.LENGTH
    assert check_stop(p, 3, 1, 100, 100, {2}) is FinishReason.LENGTH  # the context is full
    assert check_stop(p, 3, 1, 10, 100, {2}) is None


def test_prompt_checks():
    assert check_prompt_ids((1, 2), 10, 5) == [1, 2]
    for ids, field in (([], "prompt"), ([1, 10], "prompt_token_ids"), ([1] * 5, "prompt")):
        with pytest.raises(InvalidRequestError) as e:
            check_prompt_ids(ids, 10, 5)
        assert e.value.field == field


def test_generate_request_from_plain_values():
    req = generate_request(messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 4})
    assert req.WhichOneof("input") == "messages" and req.sampling.max_tokens == 4
    assert not req.sampling.HasField("temperature")  # a mapping sets only what it names
    req = generate_request(prompt_token_ids=[1, 2], sampling=SET)
    assert list(req.prompt_token_ids.ids) == [1, 2] and sampling_from_proto(req.sampling) == SET

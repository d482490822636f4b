"""Structured output over gRPC and in the engine: every answer fits its constraint, across the
prefill/decode split, from the prefix cache and after preemption; bad constraints are refused naming
the field. The default model, the session's stack."""

from __future__ import annotations

import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch
from prometheus_client import REGISTRY

from baton.api import InvalidRequestError, SamplingParams
from baton.api.client import Client, generate_request
from baton.api.params import MAX_CONSTRAINT_CHARS, Constraint, FinishReason, check_stop
from baton.api.proto import constraint_from_proto, constraint_to_proto, sampling_from_proto, sampling_to_proto
from baton.bench.schemas import SCHEMAS
from baton.engine.sampling import unpack_bitmask
from baton.grammar import Grammars
from baton.v1 import generation_pb2 as pb
from tests.stack_state import idle, stats

SAMPLES = 10
CHOICES = ("red", "green", "blue", "light yellow")
CHOICE = pb.Constraint(choice=pb.Choices(choices=CHOICES))
PROMPT = "Answer with JSON about a person, a shop order or the weather."
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}(\.[0-9])?"


def _schema(name: str) -> pb.Constraint:
    return pb.Constraint(json_schema=json.dumps(SCHEMAS[name]))


def _sampling(constraint: pb.Constraint, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(constraint=constraint, **{"max_tokens": 300, "temperature": 0.8, **kw})


# -- the request layer, no model -------------------------------------------------------------------------


def test_constraint_bounds_and_kinds_name_the_field():
    cases = [
        (dict(kind="nope"), "constraint"),
        (dict(kind="regex", value="x" * (MAX_CONSTRAINT_CHARS + 1)), "constraint.regex"),
        (dict(kind="regex", value=""), "constraint.regex"),
        (dict(kind="json_schema", value="{not json"), "constraint.json_schema"),
        (dict(kind="json_schema", value="[1, 2]"), "constraint.json_schema"),
        (dict(kind="choice", choices=()), "constraint.choice"),
        (dict(kind="choice", choices=("a",) * 257), "constraint.choice"),
        (dict(kind="choice", choices=("a", "")), "constraint.choice"),
        (dict(kind="choice", choices=("x" * 1025,)), "constraint.choice"),
        (dict(kind="regex", value="a", choices=("a",)), "constraint.regex"),
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidRequestError) as e:
            Constraint(**kwargs)
        assert e.value.field == field, kwargs
    assert Constraint("choice", choices=["a", "b"]).choices == ("a", "b")


def test_constraint_proto_round_trip_and_key():
    for c in (Constraint("json_schema", json.dumps(SCHEMAS["person"])), Constraint("json_object"),
              Constraint("regex", REGEX), Constraint("choice", choices=CHOICES), Constraint("grammar", 'start: "a"')):
        assert constraint_from_proto(constraint_to_proto(c)) == c
        assert sampling_from_proto(sampling_to_proto(SamplingParams(constraint=c))).constraint == c
    assert constraint_from_proto(pb.Constraint()) is None
    assert Constraint("regex", "ab").key != Constraint("grammar", "ab").key  # the kind is part of the key
    assert Constraint("choice", choices=("a", "b")).key != Constraint("choice", choices=("ab",)).key


def test_check_stop_ends_a_complete_structure_but_never_calls_length_stop():
    params = SamplingParams(max_tokens=3)
    assert check_stop(params, 5, 1, 10, 100, {0}, constraint_done=True) is FinishReason.STOP
    assert check_stop(params, 5, 3, 10, 100, {0}, constraint_done=False) is FinishReason.LENGTH
    assert check_stop(params, 5, 1, 10, 100, {0}) is None


def test_unpack_bitmask_matches_bit_by_bit():
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    got = unpack_bitmask(words, 150)
    want = torch.tensor([[(int(words[r, t // 32]) >> (t % 32)) & 1 == 1 if t < 160 else False for t in range(150)]
                         for r in range(3)])
    assert torch.equal(got, want)
    assert not unpack_bitmask(words, 170)[:, 160:].any()  # ids past the mask are never allowed


@pytest.fixture(scope="module")
def grammars(default_model):
    return Grammars(default_model.tokenizer)


def test_compiler_refuses_bad_constraints_with_its_message(grammars):
    for c, words in ((Constraint("regex", "(ab"), "unclosed group"),
                     (Constraint("json_schema", json.dumps({"type": "no-such-type"})), "no-such-type"),
                     (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
                     (Constraint("grammar", "root ::= ("), "GBNF")):
        with pytest.raises(InvalidRequestError) as e:
            grammars.compile(c)
        assert e.value.field == c.field and words in str(e.value), str(e.value)


def test_compiled_grammars_are_cached_by_content(grammars):
    c = Constraint("json_schema", json.dumps(SCHEMAS["order"]))
    first, cached = grammars.compile(c)
    again, cached_again = grammars.compile(Constraint("json_schema", json.dumps(SCHEMAS["order"])))
    assert again is first and cached_again and not cached
    # Each request gets a matcher of its own: advancing one leaves the next at the start.
    m = first.matcher()
    brace = grammars.tokenizer.tokenize_str("{")[0]
    assert m.consume(brace)
    assert first.matcher().consume(brace)


def test_a_compile_past_the_time_bound_is_refused_naming_the_field(default_model):
    # A grammar of 2,000 rules takes tens of milliseconds to compile (45 ms measured); the bound is 2 ms. The
    # compiler's view of the tokenizer is built first (once per Grammars, about 0.2 s): the bound must not hang on
    # it, nor on whether the compile thread happens to finish before the wait starts.
    n = 2000
    rules = "\n".join(f'r{i}: "tok{i}" r{(i + 1) % n}?' for i in range(n))
    slow = Constraint("grammar", "start: " + " | ".join(f"r{i}" for i in range(n)) + "\n" + rules)
    grammars = Grammars(default_model.tokenizer, timeout_s=0.002)
    assert grammars.tokenizer is not None
    with pytest.raises(InvalidRequestError) as e:
        grammars.compile(slow)
    assert e.value.field == "constraint.grammar" and "to compile" in str(e.value)


# -- the engine, in process -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(default_model):
    from baton.config import EngineConfig
    from baton.engine.engine import LLMEngine
    from baton.engine.model_runner import KVCache
    mc = default_model.config
    block = KVCache.bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
    # A pool of 40 blocks: 12 constrained answers of about 8 blocks each do not fit at once, so some are
    # preempted and recomputed.
    return LLMEngine(EngineConfig(kv_cache_memory=40 * block, block_size=16, max_num_seqs=12),
                     loaded=default_model)


def test_preempted_and_recomputed_answers_still_fit(engine):
    # Sixteen codes: every answer is about a hundred tokens, so twelve of them outgrow the pool's 40 blocks.
    schema = {"type": "object", "properties": {"codes": {"type": "array", "minItems": 16, "maxItems": 16, "items": {
        "type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}}}, "required": ["codes"], "additionalProperties": False}
    prompt = engine.encode_prompt("Write sixteen product codes as JSON.", chat=True)
    params = SamplingParams(max_tokens=300, temperature=0.8, constraint=Constraint("json_schema", json.dumps(schema)))
    before = engine.scheduler.num_preemptions
    # Seeded: the same twelve answers on every run (an unseeded one may wander in whitespace to max_tokens).
    outs = engine.generate([prompt] * 12, [dataclasses.replace(params, seed=100 + i) for i in range(12)])
    assert engine.scheduler.num_preemptions > before, "the pool was meant to be too small for 12 at once"
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, len(o.token_ids), o.text[:200])
        jsonschema.validate(json.loads(o.text), schema)


def test_constrained_and_free_rows_share_a_batch_without_touching_each_other(engine):
    prompts = [engine.encode_prompt(f"Tell me about the number {i}.", chat=True) for i in range(4)]
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = engine.generate(prompts, free)
    choice = SamplingParams(max_tokens=12, temperature=0, constraint=Constraint("choice", choices=CHOICES))
    # top_k: masked before the cut, by the runner during the forward pass (the others check first)
    cut = SamplingParams(max_tokens=12, temperature=1.0, top_k=5, constraint=Constraint("choice", choices=CHOICES))
    mixed = engine.generate(prompts * 3, [free] * 4 + [choice] * 4 + [cut] * 4)
    assert [o.token_ids for o in mixed[:4]] == [o.token_ids for o in alone]
    assert all(o.text in CHOICES and o.finish_reason == "stop" for o in mixed[4:])
    assert engine.last_masks is None  # the last pass had no constrained row left


# -- over gRPC, through the disaggregated stack -----------------------------------------------------------


@pytest.fixture(scope="module")
def client(stack):
    with Client(stack.address) as c:
        yield c


def _many(client, requests: list[pb.GenerateRequest]):
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda r: client.complete(r, timeout=300), requests))


def test_ten_schemas_ten_samples_each_validate(client):
    names = list(SCHEMAS)
    reqs = [generate_request(messages=[{"role": "user", "content": f"{PROMPT} ({name} #{i})"}],
                             sampling=_sampling(_schema(name)))
            for name in names for i in range(SAMPLES)]
    outs = _many(client, reqs)
    for k, out in enumerate(outs):
        schema = SCHEMAS[names[k // SAMPLES]]
        assert out.finish_reason == "stop", (names[k // SAMPLES], out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outs}) > len(SCHEMAS)  # sampled, not one answer per schema


def test_regex_choice_json_object_and_grammar(client):
    grammar = 'start: "The answer is " NUM "."\nNUM: /[0-9]{1,3}/'
    reqs = ([generate_request(PROMPT, sampling=_sampling(pb.Constraint(regex=REGEX), max_tokens=40))] * SAMPLES
            + [generate_request(PROMPT, sampling=_sampling(CHOICE))] * SAMPLES
            # top_p: these rows' masks come before the cut, computed while the forward pass runs
            + [generate_request(PROMPT, sampling=_sampling(pb.Constraint(grammar=grammar), max_tokens=40,
                                                           top_p=0.95))] * SAMPLES
            + [generate_request(PROMPT, sampling=_sampling(pb.Constraint(json_object=True), temperature=0))])
    outs = _many(client, reqs)
    for out in outs[:SAMPLES]:
        assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop", out.text
    for out in outs[SAMPLES:2 * SAMPLES]:
        assert out.text in CHOICES and out.finish_reason == "stop", out.text
    for out in outs[2 * SAMPLES:3 * SAMPLES]:
        assert re.fullmatch(r"The answer is [0-9]{1,3}\.", out.text) and out.finish_reason == "stop", out.text
    obj = outs[-1]
    assert obj.finish_reason in ("stop", "length")
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.text.startswith("{")


def test_the_first_token_sampled_by_the_prefill_worker_obeys(client):
    """max_tokens 1: the prefill worker's token is the whole answer. Unconstrained, the same prompt at
    temperature 1.5 starts in many ways; constrained, only with a prefix of a choice or a JSON object."""
    def firsts(constraint):
        sp = pb.SamplingParams(max_tokens=1, temperature=1.5, **({"constraint": constraint} if constraint else {}))
        return [o.text for o in _many(client, [generate_request(PROMPT, sampling=sp)] * 20)]

    free = firsts(None)
    assert not all(any(c.startswith(t) for c in CHOICES) for t in free)  # the check below could fail
    assert all(t and any(c.startswith(t) for c in CHOICES) for t in firsts(CHOICE))
    assert all(t.startswith("{") for t in firsts(_schema("nested")))


def test_answers_from_the_prefix_cache_fit_too(client):
    prompt = "You are a careful clerk. " * 20 + "Write the order."
    req = generate_request(prompt, sampling=_sampling(_schema("order")))
    first = client.complete(req, timeout=120)
    again = client.complete(req, timeout=120)
    assert again.usage.cached_prompt_tokens > 0
    for out in (first, again):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMAS["order"])


def test_max_tokens_inside_a_structure_is_length_not_stop(client):
    out = client.complete(generate_request(PROMPT, sampling=_sampling(_schema("nested"), max_tokens=6)), timeout=60)
    assert out.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("constraint, field, words", [
    (pb.Constraint(json_schema=json.dumps({"type": "object", "properties": {"a": {"type": "no-such-type"}}})),
     "sampling.constraint.json_schema", "no-such-type"),
    (pb.Constraint(json_schema="{oops"), "sampling.constraint.json_schema", "not valid JSON"),
    (pb.Constraint(regex="(ab"), "sampling.constraint.regex", "unclosed group"),
    (pb.Constraint(grammar="start: missing"), "sampling.constraint.grammar", "missing"),
    (pb.Constraint(grammar="start: " + " | ".join(f'"{i}"' for i in range(12000))), "sampling.constraint.grammar",
     "at most 65536"),
    (pb.Constraint(choice=pb.Choices()), "sampling.constraint.choice", "non-empty"),
])
def test_bad_constraints_are_invalid_argument_and_the_stack_keeps_serving(client, constraint, field, words):
    with pytest.raises(grpc.RpcError) as e:
        client.complete(generate_request(PROMPT, sampling=_sampling(constraint)), timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field) and words in e.value.details(), e.value.details()
    ok = client.complete(generate_request(PROMPT, sampling={"max_tokens": 4}), timeout=60)
    assert ok.finish_reason in ("stop", "length")


def test_compile_metrics_and_worker_caches(stack, client):
    model = client.list_models()[0].id
    client.complete(generate_request(PROMPT, sampling=_sampling(_schema("person"))), timeout=60)

    def count(cached: str) -> float:
        return REGISTRY.get_sample_value("baton_grammar_compile_seconds_count",
                                         {"model": model, "worker": "router", "cached": cached}) or 0.0

    hits = count("true")
    client.complete(generate_request(PROMPT, sampling=_sampling(_schema("person"))), timeout=60)
    assert count("true") == hits + 1 and count("false") >= 1
    assert (REGISTRY.get_sample_value("baton_constrained_requests_total",
                                      {"model": model, "worker": "router", "kind": "json_schema"}) or 0) >= 2
    pre, dec = stats(stack)
    assert all(p["grammar_hits"] >= 1 for p in pre) and all(d["grammar_hits"] >= 1 for d in dec)
    assert idle(stack)


# -- tools for the chat template ----------------------------------------------------------------------------


def test_a_template_that_renders_tools_gets_them(default_model):
    from baton.tokenizer import Tokenizer, TokenizerError

    t = default_model.tokenizer
    template = ("{% if tools %}Tools:{% for tool in tools %} {{ tool.function.name }}{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    with_tools = Tokenizer(t._backend, vocab_size=t.vocab_size, bos_token_id=t.bos_token_id,
                           eos_token_id=t.eos_token_id, eos_token_ids=t.eos_token_ids,
                           special_token_ids=t.special_token_ids, add_bos=t.add_bos, chat_template=template)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    assert with_tools.chat_tools and not t.chat_tools
    rendered = with_tools.apply_chat_template(msgs, tools=tools)
    assert rendered.startswith("Tools: get_weather") and "user: Weather in Oslo?" in rendered
    assert not with_tools.apply_chat_template(msgs).startswith("Tools")
    with pytest.raises(TokenizerError, match="does not render tools"):
        t.apply_chat_template(msgs, tools=tools)


def test_tools_for_a_template_without_them_are_refused_naming_the_field(client):
    assert client.list_models()[0].chat_tools is False
    tools = json.dumps([{"type": "function", "function": {"name": "f"}}])
    req = generate_request(messages=[{"role": "user", "content": "hi"}], sampling={"max_tokens": 2})
    req.messages.tools = tools
    with pytest.raises(grpc.RpcError) as e:
        client.complete(req, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("messages.tools") and "does not render tools" in e.value.details()


def test_checking_first_samples_exactly_the_masked_distribution(grammars):
    """A row that samples as if free and redraws under its mask when refused picks allowed token t with
    probability p(t) / A, as sampling under the mask does; and a greedy row gets the masked argmax."""
    from baton.engine.sampling import Sampler, SamplingState

    grammar, _ = grammars.compile(Constraint("regex", "[0-9]"))
    vocab = grammars.tokenizer.vocab_size
    digits = [grammars.tokenizer.tokenize_str(str(d))[0] for d in range(10)]
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, vocab, generator=g)
    logits[0, digits] += torch.linspace(8.0, 10.0, 10)  # the digits hold about half the mass, unevenly
    probs = torch.softmax(logits[0], dim=-1)
    allowed_mass = float(probs[digits].sum())
    assert 0.2 < allowed_mass < 0.8  # so that both paths, kept and redrawn, happen often

    def compute(states):
        bitmask = torch.zeros((len(states), -(-vocab // 32)), dtype=torch.int32)
        for k, st in enumerate(states):
            st.matcher.raw.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), bitmask.shape[1] * 4)
        return bitmask

    n = 4000
    params = SamplingParams(temperature=1.0, seed=7, constraint=Constraint("regex", "[0-9]"))
    states = [SamplingState.create(params, [1], "cpu", grammar.matcher()) for _ in range(n)]
    for i, st in enumerate(states):
        st.seed = i  # each row's draws derive from its seed (and the position: 0 for all here)
    assert all(st.checks_first for st in states)
    out = Sampler()(logits.expand(n, vocab).contiguous(), states, None, compute).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=vocab)
    assert int(counts[digits].sum()) == n  # never a token outside the constraint
    want = probs[digits] / allowed_mass
    got = counts[digits].float() / n
    assert float((got - want).abs().max()) < 0.03, (got, want)  # 4000 draws: a standard error below 0.008

    greedy = SamplingParams(temperature=0, constraint=Constraint("regex", "[0-9]"))
    free_top = next(t for t in range(vocab) if t not in digits)
    logits[0, free_top] = 100.0  # the free argmax is refused, so the masked one must be found
    state = SamplingState.create(greedy, [1], "cpu", grammar.matcher())
    assert Sampler()(logits, [state], None, compute).token_ids == [digits[int(torch.argmax(logits[0, digits]))]]

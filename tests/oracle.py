"""The correctness oracle: greedy decoding with transformers on the same weights, and the near-tie rule."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# A differing greedy token is accepted only when the reference scored both within this many logits
# (float32), as vLLM's check_logprobs_close accepts near-ties. Anything else must match exactly.
NEAR_TIE_LOGIT_GAP = 1e-2


@dataclass
class Reference:
    token_ids: list[int]
    logits: list[torch.Tensor]  # float32 [vocab] that chose each token


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, vocab_limit: int | None = None) -> Reference:
    """Greedy decoding with a transformers causal LM (KV cache on), ignoring EOS.

    vocab_limit: the tokenizer's vocabulary size when the model pads its embedding past it; the
    engine never samples the padding ids, so neither does the reference."""
    # transformers 5 renamed past_key_values to cache; accept both.
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        step_logits = out.logits[0, -1, :vocab_limit].float()
        tok = int(step_logits.argmax())
        tokens.append(tok)
        logits.append(step_logits)
        out = model(torch.tensor([[tok]]), use_cache=True, **{key: out[key]})
    return Reference(tokens, logits)


def assert_greedy_match(ours: list[int], ref: Reference, label: str = "", gap: float = NEAR_TIE_LOGIT_GAP) -> None:
    """Token-identical, except a first divergence at a near-tie (after which the texts differ legitimately).

    gap: the largest accepted logit gap; half-precision runs pass a wider one."""
    assert len(ours) == len(ref.token_ids), f"{label}: {len(ours)} tokens vs reference {len(ref.token_ids)}"
    for i, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a == b:
            continue
        lg = ref.logits[i]
        diff = float(lg[b] - lg[a])
        assert diff <= gap, (
            f"{label}: token {i} is {a} but the reference chose {b} by a logit gap of {diff:.4f} "
            f"(ours {ours}, reference {ref.token_ids})")
        return


def hf_from_loaded(loaded):
    """A transformers Llama holding exactly the weights Baton loaded (so both run the same model)."""
    import transformers

    c = loaded.config
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


@torch.inference_mode()
def assert_same_or_near_tie(ours: list[int], expected: list[int], prompt: list[int], hf, label: str = "") -> None:
    """Two Baton runs (e.g. disaggregated vs single-process) agree token for token, or first differ where
    the float32 reference scores both tokens within NEAR_TIE_LOGIT_GAP."""
    assert len(ours) == len(expected), f"{label}: {len(ours)} tokens vs {len(expected)}"
    for i, (a, b) in enumerate(zip(ours, expected)):
        if a != b:
            logits = hf(torch.tensor([prompt + expected[:i]])).logits[0, -1].float()
            gap = abs(float(logits[a] - logits[b]))
            top = float(logits.max())
            assert gap <= NEAR_TIE_LOGIT_GAP and top - max(logits[a], logits[b]) <= NEAR_TIE_LOGIT_GAP, (
                f"{label}: token {i} is {a}, expected {b}; logit gap {gap:.4f}")
            return


def tiny_case(hf_class, folder, lengths: list[int], seed: int, max_new_tokens: int):
    """A tiny model the test built in ``folder``: (transformers' float32 model, Baton's LoadedModel, random prompts
    of ``lengths`` within the tokenizer's vocabulary, transformers' greedy reference for each)."""
    from baton.loader import load_model

    hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
    loaded = load_model(str(folder))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, loaded.tokenizer.vocab_size, (n,), generator=g).tolist() for n in lengths]
    refs = [hf_greedy(hf, p, max_new_tokens, loaded.tokenizer.vocab_size) for p in prompts]
    return hf, loaded, prompts, refs


def handed_off(prefill, decode, prompt: list[int], params) -> list[int]:
    """What the disaggregated stack does, engine to engine: ``prefill`` computes the prompt and its first token and
    exports the KV, ``decode`` imports it and generates the rest. Returns every output token, the first (which
    ``decode`` emits on arrival) included."""
    from baton.api import SamplingParams

    rid = prefill.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), export_kv=True)
    (first,) = [o for o in prefill.step() if o.request_id == rid]
    decode.add_prefilled(prompt, first.token_ids[0], params, decode.reserve_blocks(len(prompt)), first.kv)
    tokens = []
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.token_ids]
    return tokens


def assert_int8_kv_paths_agree(make_engine, prompts: list[list[int]], max_tokens: int = 12) -> None:
    """int8 KV cache (per-token, per-head scales): the C kernels and the torch references reading the same int8
    cache give the same greedy tokens, chunked in passes of 7 tokens over blocks of 4 (a first difference only at
    a near tie of the reference's own log-probs); and the int8 KV handed from one engine to another continues as
    one engine does. ``make_engine(**engine_config)`` builds an engine of the model under test."""
    from baton.api import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    kw = dict(kv_dtype="int8", block_size=4, max_num_batched_tokens=7)
    ours = make_engine(**kw).generate(prompts, params)
    assert make_engine(**kw).kv_cache.layers[0].k.dtype == torch.int8
    refs = make_engine(**kw, attention="torch").generate(prompts, params)
    for i, (a, b) in enumerate(zip(ours, refs)):
        diff = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if diff is not None:
            top = dict(zip(b.top_logprobs[diff].token_ids, b.top_logprobs[diff].logprobs))
            assert a.token_ids[diff] in top and top[b.token_ids[diff]] - top[a.token_ids[diff]] <= NEAR_TIE_LOGIT_GAP, (
                f"prompt {i}: int8 KV, C kernels {a.token_ids} against the torch references {b.token_ids}")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        moved = handed_off(make_engine(kv_dtype="int8"), make_engine(kv_dtype="int8"), p, greedy)
        single = make_engine(kv_dtype="int8").generate([p], greedy)[0].token_ids
        assert moved == single, f"prompt {i}: hand-off {moved}, one engine {single}"

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

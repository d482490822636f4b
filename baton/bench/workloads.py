"""Seeded, reproducible workloads: the same prompts (as text, cut to exact token counts with the
model's tokenizer) and output lengths for every server a run compares."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TEXT = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name "
         "president team minute idea kid body information back parent face others level office door health "
         "person art war history party result change morning reason research girl guy moment air teacher force "
         "education")
WORDS = tuple(_TEXT.split())


@dataclass(frozen=True)
class BenchRequest:
    id: str
    prompt: str
    prompt_tokens: int  # by the tokenizer that built it
    max_tokens: int
    kind: str = "chat"  # chat | shared | long | edit | file


def parse_range(text: str | int) -> tuple[int, int]:
    """"128" -> (128, 128); "50:200" -> (50, 200)."""
    lo, _, hi = str(text).partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise ValueError(f"range {text!r}: want N or MIN:MAX with 1 <= MIN <= MAX")
    return a, b


class PromptMaker:
    """Text of exactly ``n`` tokens: random words, then cut to length with the tokenizer (decode of the
    first n ids; re-encoding may differ by a token, which the request records)."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str]) -> None:
        self.encode = encode
        self.decode = decode

    def make(self, rng: random.Random, n: int, head: str = "") -> tuple[str, int]:
        words = [head] if head else []
        text = head
        while len(self.encode(text)) < n:
            words += [rng.choice(WORDS) for _ in range(max(8, n // 2))]
            text = " ".join(words)
        ids = self.encode(text)[:n]
        text = self.decode(ids)
        return text, len(self.encode(text))


def chat(maker: PromptMaker, n: int, seed: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int]
         ) -> list[BenchRequest]:
    """Independent prompts with lengths uniform in ``prompt_tokens``; outputs uniform in ``output_tokens``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text, k = maker.make(rng, rng.randint(*prompt_tokens), head=f"Request {i}:")
        out.append(BenchRequest(f"chat-{i}", text, k, rng.randint(*output_tokens)))
    return out


def shared_prefix(maker: PromptMaker, n: int, seed: int, system_tokens: int, prompt_tokens: tuple[int, int],
                  output_tokens: tuple[int, int]) -> list[BenchRequest]:
    """One system prompt of ``system_tokens`` tokens, then a distinct question per request."""
    rng = random.Random(seed)
    system, _ = maker.make(random.Random(seed + 1), system_tokens, head="You are a helpful assistant. Rules:")
    out = []
    for i in range(n):
        q, _ = maker.make(rng, rng.randint(*prompt_tokens), head=f"\nQuestion {i}:")
        text = system + q
        out.append(BenchRequest(f"shared-{i}", text, len(maker.encode(text)), rng.randint(*output_tokens), "shared"))
    return out


def long_prompt(maker: PromptMaker, n: int, seed: int, prompt_tokens: tuple[int, int],
                output_tokens: tuple[int, int], long_tokens: int, long_every: int) -> list[BenchRequest]:
    """Chat requests with a very long prompt as every ``long_every``-th request (each different)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if long_every and i % long_every == long_every // 2:
            text, k = maker.make(rng, long_tokens, head=f"Document {i}:")
            out.append(BenchRequest(f"long-{i}", text, k, rng.randint(*output_tokens), "long"))
        else:
            text, k = maker.make(rng, rng.randint(*prompt_tokens), head=f"Request {i}:")
            out.append(BenchRequest(f"chat-{i}", text, k, rng.randint(*output_tokens)))
    return out


_STATEMENTS = (
    "{v} = {a} + {b}",
    "{v} = {a} * {n}",
    "{v} = [x for x in {a} if x > {n}]",
    "if {a} > {b}:\n{i}    {v} = {a} - {b}\n{i}else:\n{i}    {v} = {b} - {a}",
    "for {w} in range({n}):\n{i}    {v} += {w} * {a}",
    "{v} = max({a}, {b}, {n})",
    "{v} = {{'{w}': {a}, '{v}': {b}}}",
    "while {v} < {n}:\n{i}    {v} += {a}",
    "{v} = str({a}).strip().lower()",
    "{v} = sorted({a}, key=lambda x: -x)",
)


def _function(rng: random.Random, lines: int) -> str:
    """A Python function of about ``lines`` statements over random names."""
    words = [w for w in WORDS if w.isidentifier()]
    name = "_".join(rng.sample(words, 2))
    args = rng.sample(words, 3)
    names = list(args)
    body = []
    for _ in range(lines):
        v = rng.choice(words)
        stmt = rng.choice(_STATEMENTS).format(v=v, a=rng.choice(names), b=rng.choice(names), n=rng.randint(2, 99),
                                              w=rng.choice(words), i="    ")
        body.append("    " + stmt)
        names.append(v)
    body.append(f"    return {names[-1]}")
    return f"def {name}({', '.join(args)}):\n" + "\n".join(body)


def edit(maker: PromptMaker, n: int, seed: int, output_tokens: tuple[int, int]) -> list[BenchRequest]:
    """Rewrite or fix a given passage, where the answer repeats much of the prompt: a Python function to rename a
    variable in, or a paragraph to correct (its words with a typo every few). The passage is about as long as the
    output, so the answer can be mostly a copy (prompt-lookup speculation's case)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        want = rng.randint(*output_tokens)
        if i % 2 == 0:
            lines = 4
            code = _function(rng, lines)
            while len(maker.encode(code)) < want and lines < 400:
                lines += 2
                code = _function(random.Random(f"{seed}-{i}"), lines)
            old = code.split("(", 1)[1].split(",", 1)[0]
            text = (f"Rename the argument `{old}` to `{old}_value` in this function and reply with the whole "
                    f"function.\n\n```python\n{code}\n```\n\nThe function with `{old}` renamed:\n\n```python\n")
        else:
            passage, _ = maker.make(rng, want)
            words = passage.split()
            for j in range(0, len(words), 7):  # a typo every seven words: two letters swapped
                w = words[j]
                if len(w) > 3:
                    words[j] = w[0] + w[2] + w[1] + w[3:]
            text = ("Correct the spelling in this text and reply with the whole corrected text.\n\nText: "
                    f"{' '.join(words)}\n\nCorrected text:")
        out.append(BenchRequest(f"edit-{i}", text, len(maker.encode(text)), want, "edit"))
    return out


def from_file(path: str | Path, n: int | None, maker: PromptMaker, output_tokens: tuple[int, int], seed: int
              ) -> list[BenchRequest]:
    """JSONL, one object per line: {"prompt": TEXT, "max_tokens": N (optional)}; cycled to ``n``."""
    rows = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{lineno}: want a JSON object with a \"prompt\" string ({e})") from e
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{path}:{lineno}: \"prompt\" must be a non-empty string")
        rows.append((prompt, obj.get("max_tokens")))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    rng = random.Random(seed)
    count = n or len(rows)
    return [BenchRequest(f"file-{i}", rows[i % len(rows)][0], len(maker.encode(rows[i % len(rows)][0])),
                         int(rows[i % len(rows)][1] or rng.randint(*output_tokens)), "file") for i in range(count)]


__all__ = ["BenchRequest", "PromptMaker", "chat", "edit", "from_file", "long_prompt", "parse_range", "shared_prefix"]

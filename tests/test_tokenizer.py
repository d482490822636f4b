"""baton.tokenizer against transformers' tokenizers for the same files, plus its own contracts."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path
from types import SimpleNamespace as Builders
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from baton.loader import LoadedModel, ModelLoadError, load_model
from baton.loader.gguf import read_gguf_metadata, tokenizer_from_gguf
from baton.loader.hf import tokenizer_from_hf_folder
from baton.tokenizer import Tokenizer, TokenizerError

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159265.",
    "1234567890 0 00 007 1,000,000",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "multiple     spaces      here",
    "naïve café über straße résumé",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "emoji 🙂🚀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_start|>",
    "It's, I'm, we're, they've, he'd, you'll",
    "URL: https://example.com/path?q=1&r=two#frag",
    "",
    " ",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "MiXeD CaSe AND SHOUTING",
    "x² + y² = r²",  # superscripts are letters-adjacent numbers (\p{No})
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke about 🐍 and <code>."},
    ],
]


def _ids(encoding) -> list[int]:
    """input_ids from whatever transformers' apply_chat_template(tokenize=True) returned."""
    if isinstance(encoding, list):
        return encoding
    return list(encoding["input_ids"])


def _not_a_spaced_number(c: str) -> bool:
    """See test_default_numbers_follow_llama_cpp: ASCII digits agree with transformers, other numerics not."""
    return c.isascii() or unicodedata.category(c)[0] != "N"


def _no_space_run_before_a_number(text: str) -> bool:
    """See test_default_numbers_follow_llama_cpp: two or more spaces before a digit split differently."""
    return not any(text[i].isspace() and text[i + 1].isspace() and unicodedata.category(text[i + 2])[0] == "N"
                   for i in range(len(text) - 2))


# ---- the default model: SmolLM2 GGUF --------------------------------------------------------------------


@pytest.fixture(scope="module")
def ours(default_model: LoadedModel) -> Tokenizer:
    return default_model.tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_default_ids_match_transformers(ours: Tokenizer, transformers_default_tokenizer: Any, text: str) -> None:
    ref = transformers_default_tokenizer
    assert ours.encode(text) == ref(text)["input_ids"]
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)).filter(_not_a_spaced_number), max_size=40)
       .filter(_no_space_run_before_a_number))
def test_default_ids_match_transformers_on_any_text(ours: Tokenizer, transformers_default_tokenizer: Any,
                                                    text: str) -> None:
    ids = ours.encode(text)
    assert ids == transformers_default_tokenizer(text)["input_ids"]
    decoded = ours.decode(ids, skip_special_tokens=False)
    assert decoded == transformers_default_tokenizer.decode(ids, skip_special_tokens=False)
    # SmolLM2's vocabulary lacks a few byte tokens (some C0 controls, the UTF-8 lead bytes of U+40000
    # and up), which BPE then drops; everything else must round-trip.
    if all(ord(c) < 0x40000 and unicodedata.category(c) != "Cc" for c in text):
        assert decoded == text


@pytest.mark.slow
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_chat_template_matches_transformers(ours: Tokenizer, transformers_default_tokenizer: Any,
                                                    conversation, add_generation_prompt: bool) -> None:
    ref = transformers_default_tokenizer
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(conversation, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
    assert ours.encode_chat(conversation, add_generation_prompt) == _ids(
        ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt))


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 🙂", "a — b", "<|im_end|>x"])
def test_token_bytes_spell_the_text_even_inside_a_character(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    pieces = [ours.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode() == ours.decode(ids, skip_special_tokens=False) == text
    with pytest.raises(TokenizerError):
        ours.token_bytes(ours.vocab_size)


def test_token_bytes_split_a_character_where_the_vocabulary_does(ours: Tokenizer) -> None:
    ids = ours.encode("語", add_special_tokens=False)
    assert len(ids) > 1 and all(ours.decode([i]) == "\ufffd" for i in ids)  # no token is a whole character
    assert b"".join(ours.token_bytes(i) for i in ids) == "語".encode()


def test_default_special_tokens(ours: Tokenizer) -> None:
    im_start, im_end, endoftext = (ours.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert (endoftext, im_start, im_end) == (0, 1, 2)
    assert ours.vocab_size == 49152 and not ours.add_bos and ours.bos_token_id == 1
    # Generation stops at <|im_end|> (the GGUF's eos) and at <|endoftext|>, never at <|im_start|>.
    assert ours.eos_token_ids == {im_end, endoftext}
    assert ours.is_special(im_start) and ours.is_special(im_end) and not ours.is_special(ours.encode("Hi")[0])
    # Control tokens in text are one token each, and plain text around them is unaffected.
    assert ours.encode("<|im_start|>user") == [im_start, *ours.encode("user")]
    assert ours.decode([im_start, *ours.encode("user"), im_end]) == "user"
    assert ours.encode_chat([{"role": "user", "content": "Hi"}])[-4:] == ours.encode("<|im_start|>assistant\n")


def test_default_numbers_follow_llama_cpp(ours: Tokenizer, transformers_default_tokenizer: Any) -> None:
    """Every \\p{N} character is its own pre-token, as llama.cpp's "smollm" regex and SmolLM2's own
    tokenizer.json (Digits(individual_digits=True)) have it.

    transformers' GGUF conversion ignores tokenizer.ggml.pre = "smollm" and uses GPT-2's split, which joins
    a space with a following number (" ½" starts with the token "ĠÂ"). The vocabulary has no multi-digit or space+digit
    tokens for ASCII digits, so the two agree there; they differ only before non-ASCII numerics.
    """
    ids = ours.encode("x 31415926")
    assert [ours.decode([i]) for i in ids] == ["x", " ", "3", "1", "4", "1", "5", "9", "2", "6"]
    assert ids == transformers_default_tokenizer("x 31415926")["input_ids"]
    pieces = [ours.decode([i]) for i in ours.encode("a ½ x²")]
    assert pieces == ["a", " ", "½", " x", "²"]
    assert transformers_default_tokenizer(" ½")["input_ids"] != ours.encode(" ½")  # the known difference
    # The same split shows when a run of spaces meets a digit: the digit is split off first, so the spaces
    # stay one pre-token ("  " + "0"); GPT-2's regex leaves the last space to the number (" " + " 0").
    assert [ours.decode([i]) for i in ours.encode("  0")] == ["  ", "0"]
    assert transformers_default_tokenizer("  0")["input_ids"] != ours.encode("  0")


# ---- the tiny Hugging Face folder ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: Path):
    import transformers

    return tokenizer_from_hf_folder(tiny_llama_dir), transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.mark.parametrize("text", TEXTS[:14])
def test_hf_folder_ids_match_transformers(tiny_pair, text: str) -> None:
    ours, ref = tiny_pair
    assert ours.encode(text) == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_hf_folder_chat_matches_transformers_with_one_bos(tiny_pair, conversation) -> None:
    ours, ref = tiny_pair
    assert ours.apply_chat_template(conversation) == ref.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True)
    ids = ours.encode_chat(conversation)
    assert ids == _ids(ref.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True))
    assert ids[0] == ours.bos_token_id and ours.bos_token_id not in ids[1:]


def test_hf_folder_metadata(tiny_pair) -> None:
    ours, _ = tiny_pair
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos) == (0, 4, True)
    assert ours.eos_token_ids == {1, 4}  # generation_config.json's list (and both are end-of-turn names)
    assert ours.vocab_size == 320 and all(ours.is_special(i) for i in range(5))


def test_hf_folder_chat_template_file_and_named_list(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "tpl"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "x"}]
    assert tokenizer_from_hf_folder(folder).apply_chat_template(msgs) == "DEFAULT"
    (folder / "chat_template.jinja").write_text("FILE {{ messages[0]['content'] }}")
    assert tokenizer_from_hf_folder(folder).apply_chat_template(msgs) == "FILE x"


def test_hf_folder_without_tokenizer_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_llama_dir, tmp_path / "notok"))
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        load_model(folder)


# ---- GGUF pre-tokenizers, on a tiny vocabulary ------------------------------------------------------------

PRE_TEXTS = ["Hello, world! 2024-05-17 and 12345678", "It's 6789 o'clock\n\n  done", "naïve 🙂 東京 x=12;",
             "def add(a, b):\n    return a + b\n"]


@pytest.fixture(scope="module")
def tiny_gguf_fields(tiny_llama_dir: Path, model_builders: Builders) -> dict:
    return model_builders.gguf_tokenizer_metadata(tiny_llama_dir / "tokenizer.json")


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_gguf_pre_tokenizers_match_transformers(pre: str, tiny_llama_dir: Path, tmp_path: Path,
                                                model_builders) -> None:
    import transformers

    path = model_builders.build_tiny_llama_gguf(tmp_path / f"{pre}.gguf", tiny_llama_dir, pre=pre)
    ours = tokenizer_from_gguf(read_gguf_metadata(path))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in PRE_TEXTS:
        assert ours.encode(text) == ref(text)["input_ids"], (pre, text)


def test_from_gguf_accepts_path_reader_and_fields(tiny_llama_dir: Path, tmp_path: Path,
                                                 model_builders: Builders) -> None:
    import gguf

    path = model_builders.build_tiny_llama_gguf(tmp_path / "t.gguf", tiny_llama_dir)
    text = "Hello, world! <|eot_id|>"
    expect = tokenizer_from_hf_folder(tiny_llama_dir).encode(text)
    assert tokenizer_from_gguf(path).encode(text) == expect
    assert tokenizer_from_gguf(str(path)).encode(text) == expect
    assert tokenizer_from_gguf(gguf.GGUFReader(str(path))).encode(text) == expect


def test_gguf_pre_tokenizers_split_numbers_differently(tiny_gguf_fields: dict) -> None:
    def pieces(pre: str, text: str) -> list[str]:
        tok = tokenizer_from_gguf({**tiny_gguf_fields, "tokenizer.ggml.pre": pre})
        return [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]

    # The trained vocabulary has multi-digit tokens; smollm never uses them, llama3 stops at 3 digits.
    assert any(len(p.strip()) > 1 and p.strip().isdigit() for p in pieces("gpt2", "2024 12345678"))
    assert all(len(p) == 1 for p in pieces("smollm", "2024 12345678") if p.strip().isdigit())
    assert all(len(p.strip()) <= 3 for p in pieces("llama-bpe", "12345678 2024") if p.strip().isdigit())


def test_unknown_gguf_pre_tokenizer(tiny_gguf_fields: dict) -> None:
    with pytest.raises(TokenizerError, match="pre-tokenizer 'mystery'"):
        tokenizer_from_gguf({**tiny_gguf_fields, "tokenizer.ggml.pre": "mystery"})
    with pytest.raises(TokenizerError, match="tokenizer model 'mystery'"):
        tokenizer_from_gguf({**tiny_gguf_fields, "tokenizer.ggml.model": "mystery"})


def test_unknown_pre_tokenizer_fails_the_load(tiny_llama_dir: Path, tmp_path: Path, model_builders: Builders) -> None:
    path = model_builders.build_tiny_llama_gguf(tmp_path / "m.gguf", tiny_llama_dir, pre="mystery")
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery'"):
        load_model(path)


def test_gguf_add_bos_and_encode_chat_adds_one(tiny_gguf_fields: dict) -> None:
    with_bos = tokenizer_from_gguf(tiny_gguf_fields)  # add_bos_token = true, template writes bos_token
    assert with_bos.encode("Hi")[0] == 0 and with_bos.encode("Hi", add_special_tokens=False)[0] != 0
    msgs = [{"role": "user", "content": "Hi"}]
    assert with_bos.encode_chat(msgs).count(0) == 1
    no_bos_template = tokenizer_from_gguf({**tiny_gguf_fields, "tokenizer.chat_template": "{{ messages[0].content }}"})
    assert no_bos_template.encode_chat(msgs) == [0, *no_bos_template.encode("Hi", add_special_tokens=False)]
    no_bos = tokenizer_from_gguf({**tiny_gguf_fields, "tokenizer.ggml.add_bos_token": False})
    assert 0 not in no_bos.encode("Hi") and no_bos.encode_chat(msgs)[0] == 0  # the template's own BOS


# ---- chat template contract ---------------------------------------------------------------------------------


def _tok(fields: dict, template: str | None) -> Tokenizer:
    return tokenizer_from_gguf({**fields, "tokenizer.chat_template": template})


def test_no_chat_template(tiny_gguf_fields: dict) -> None:
    tok = _tok(tiny_gguf_fields, None)
    assert tok.chat_template is None
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(("messages", "reason"), [
    ([{"role": "wizard", "content": "x"}], "role 'wizard'"),
    ([{"content": "x"}], "role None"),
    ([{"role": "user", "content": 3}], "string 'content'"),
    ([], "empty"),
    ("hello", "list"),
    (["hello"], "must be a dict"),
])
def test_bad_messages(tiny_gguf_fields: dict, messages, reason: str) -> None:
    with pytest.raises(TokenizerError, match=reason):
        tokenizer_from_gguf(tiny_gguf_fields).apply_chat_template(messages)


def test_template_features(tiny_gguf_fields: dict) -> None:
    msgs = [{"role": "user", "content": "é <b>"}]
    assert _tok(tiny_gguf_fields, "{{ messages | tojson }}").apply_chat_template(msgs) == \
        '[{"role": "user", "content": "é <b>"}]'
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind.
    tpl = "{% for m in messages %}\n  {% if true %}\n[{{ m.role }}]\n  {% endif %}\n{% endfor %}"
    assert _tok(tiny_gguf_fields, tpl).apply_chat_template(msgs) == "[user]\n"
    gen = "{% generation %}{{ messages[0].content }}{% endgeneration %}{{ eos_token }}"
    assert _tok(tiny_gguf_fields, gen).apply_chat_template(msgs) == "é <b><|eot_id|>"
    bad = _tok(tiny_gguf_fields, "{{ raise_exception('only user turns, please') }}")
    with pytest.raises(TokenizerError, match="only user turns, please"):
        bad.apply_chat_template(msgs)
    with pytest.raises(TokenizerError, match="does not compile"):
        _tok(tiny_gguf_fields, "{% for %}").apply_chat_template(msgs)


def test_template_is_sandboxed(tiny_gguf_fields: dict) -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TokenizerError):
        _tok(tiny_gguf_fields, escape).apply_chat_template([{"role": "user", "content": "x"}])


def test_decode_rejects_ids_outside_vocab(tiny_gguf_fields: dict) -> None:
    tok = tokenizer_from_gguf(tiny_gguf_fields)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([-1])


# ---- SentencePiece vocabularies (tokenizer.ggml.model "llama"), as llama.cpp tokenizes them -------------------

_SPM_CHARS = "abcde\u2581"
_SPM_USER = ["\n", "\n\n", "  ", "<tag>"]  # user-defined: cut out of the raw text first, whatever the flags


def _spm_fields(seed: int = 0) -> dict:
    """A small Gemma-like SentencePiece vocabulary: control tokens, 256 byte tokens, user-defined tokens, and
    normal tokens (every character, then random joins of two normal tokens) with distinct scores."""
    import random

    rng = random.Random(seed)
    normal = list(_SPM_CHARS)
    while len(normal) < 120:
        joined = rng.choice(normal) + rng.choice(normal)
        if len(joined) <= 6 and joined not in normal:
            normal.append(joined)
    order = normal[:]
    rng.shuffle(order)  # scores unrelated to length or to the order of creation
    score = {t: -float(i) for i, t in enumerate(order)}
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(tokens)
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += _SPM_USER
    types += [4] * len(_SPM_USER)
    tokens += normal
    types += [1] * len(normal)
    scores = [-1000.0 if t != 1 else 0.0 for t in types]
    scores[-len(normal):] = [score[t] for t in normal]
    return {"general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _spm_reference(fields: dict, text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenization, written the plain way: cut at user-defined tokens (longest
    first), spaces to U+2581, then join the adjacent pair whose text is a normal token with the highest score
    (the leftmost among equals) until none is; a piece that is no token is written as byte tokens."""
    tokens, types, scores = (fields[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    ids = {t: i for i, t in enumerate(tokens)}
    normal = {t: scores[i] for i, t in enumerate(tokens) if types[i] == 1}
    user = sorted((t for t, ty in zip(tokens, types) if ty == 4), key=len, reverse=True)
    out: list[int] = []
    rest = text
    while rest:
        at = min(((rest.find(u), -len(u), u) for u in user if u in rest), default=None)
        raw, cut = (rest, None) if at is None else (rest[:at[0]], at[2])
        symbols = list(raw.replace(" ", "\u2581"))
        while True:
            pairs = [(normal[a + b], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in normal]
            if not pairs:
                break
            i = -max(pairs)[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for piece in symbols:
            out += [ids[piece]] if piece in normal else [ids[f"<0x{b:02X}>"] for b in piece.encode()]
        if cut is None:
            break
        out.append(ids[cut])
        rest = rest[at[0] + len(cut):]
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 3), text=st.text(alphabet=st.sampled_from(list("abcde  \n\u00e9\u65e5<tag>")),
                                            max_size=40))
def test_sentencepiece_gguf_tokenizes_as_llama_cpp(seed: int, text: str) -> None:
    fields = _spm_fields(seed)
    tok = tokenizer_from_gguf(fields)
    assert tok.encode(text) == [2, *_spm_reference(fields, text)]
    assert tok.decode(tok.encode(text)) == text
    assert b"".join(tok.token_bytes(i) for i in tok.encode(text, add_special_tokens=False)) == text.encode()


def test_sentencepiece_gguf_specials_and_template() -> None:
    fields = _spm_fields()
    tok = tokenizer_from_gguf(fields)
    assert tok.encode("<start_of_turn>ab<end_of_turn>", add_special_tokens=False)[0] == 4  # control, parsed
    assert tok.eos_token_ids == {1, 5}  # <end_of_turn> ends a turn
    assert tok.decode(tok.encode("<start_of_turn>ab")) == "ab"
    # A Gemma file without tokenizer.chat_template gets Gemma's turns; a file's own template wins.
    text = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": " u "},
                                    {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}])
    assert text == ("<bos><start_of_turn>user\ns\n\nu<end_of_turn>\n<start_of_turn>model\na<end_of_turn>\n"
                    "<start_of_turn>user\nv<end_of_turn>\n<start_of_turn>model\n")
    assert tok.encode_chat([{"role": "user", "content": "a"}]).count(2) == 1
    with pytest.raises(TokenizerError, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    own = tokenizer_from_gguf({**fields, "tokenizer.chat_template": "{{ messages[0].content }}"})
    assert own.apply_chat_template([{"role": "user", "content": "x"}]) == "x"
    assert tokenizer_from_gguf({**fields, "general.architecture": "llama"}).chat_template is None


def test_sentencepiece_gguf_refusals() -> None:
    fields = _spm_fields()
    with pytest.raises(TokenizerError, match="add_space_prefix"):
        tokenizer_from_gguf({**fields, "tokenizer.ggml.add_space_prefix": True})
    with pytest.raises(TokenizerError, match="scores"):
        tokenizer_from_gguf({k: v for k, v in fields.items() if k != "tokenizer.ggml.scores"})

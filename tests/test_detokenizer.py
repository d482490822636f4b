"""Tests for baton.detokenizer with real tokenizers.

Three tokenizers: a byte-level BPE trained here on a small multilingual corpus (its small vocabulary splits
most non-ASCII characters across tokens), a sentencepiece-style BPE with byte fallback and the
strip-leading-space decoder (also trained here), and the default model's tokenizer loaded from its GGUF
file through transformers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from baton.detokenizer import DetokenizerFinishedError, IncrementalDetokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Straße, Äpfel, Öl und Übermut.",
    "日本語のテキストと中文文本，还有한국어 문장.",
    "Emoji time 😀😃🎉👍🏽 and flags 🇩🇪🇯🇵 plus ❤️ hearts.",
    "Math: ∑ x² ≤ ∞, arrows → ← and quotes “like this”.",
    "def add(a, b):\n    return a + b\n",
] * 3
MULTILINGUAL = "Hi there, wörld! 😀 naïve café — 日本語 and 🇯🇵 ok.\nNext: ∑ x² ≤ ∞ “done” 👍🏽"


def train_byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer


def train_sentencepiece_like() -> Tokenizer:
    """BPE over "▁"-marked words with <0xNN> byte fallback and a decoder that strips one leading space."""
    tokenizer = Tokenizer(models.BPE(byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<s>", "</s>", *byte_tokens],
        limit_alphabet=60,  # rarer characters fall back to byte tokens
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    # The trainer registers the byte tokens as special (skipped when decoding); make them ordinary.
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] not in byte_tokens]
    return Tokenizer.from_str(json.dumps(spec))


@pytest.fixture(scope="module")
def byte_bpe() -> Tokenizer:
    return train_byte_level_bpe()


@pytest.fixture(scope="module")
def sentencepiece() -> Tokenizer:
    return train_sentencepiece_like()


# Loading this tokenizer through transformers' GGUF conversion takes 6-15 s, so its tests are marked slow.
@pytest.fixture(scope="module")
def smollm2(transformers_default_tokenizer):  # type: ignore[no-untyped-def]
    """transformers' tokenizer for the default model (conftest.py): a missing model fails, saying how to
    install it."""
    return transformers_default_tokenizer


def decode(tokenizer, ids: Sequence[int], skip: bool = True) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.decode(list(ids), skip_special_tokens=skip)


def encode(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text, add_special_tokens=False)


def vocab_size(tokenizer) -> int:  # type: ignore[no-untyped-def]
    return tokenizer.get_vocab_size() if isinstance(tokenizer, Tokenizer) else len(tokenizer)


def split(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Cuts ids into consecutive chunks of the given sizes (cycled), the last one possibly shorter."""
    chunks, pos, i = [], 0, 0
    while pos < len(ids):
        size = sizes[i % len(sizes)]
        chunks.append(list(ids[pos : pos + size]))
        pos += size
        i += 1
    return chunks


def expected_output(full: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """What a character-by-character stream emits: text up to the stop occurrence that ends first."""
    best = None
    for stop in stops:
        start = full.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
            best = (start + len(stop), start, stop)
    return (full, None) if best is None else (full[: best[1]], best[2])


def stream(tokenizer, ids, chunks, stops=(), skip=True):  # type: ignore[no-untyped-def]
    """Feeds the chunks, checking after each add() that the emitted text is a prefix of the full decode.

    Returns (emitted text, stop reason, pieces returned by add()).
    """
    full = decode(tokenizer, ids, skip)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop=stops, skip_special_tokens=skip)
    pieces = []
    for chunk in chunks:
        piece, stopped = detok.add(chunk)
        pieces.append(piece)
        assert full.startswith(detok.text), (detok.text, full)
        assert detok.text == "".join(pieces)
        if stopped:
            assert detok.stop_reason is not None
            with pytest.raises(DetokenizerFinishedError):
                detok.add(chunk)
            assert detok.flush() == ""
            return detok.text, detok.stop_reason, pieces
    pieces.append(detok.flush())
    assert detok.text == "".join(pieces)
    assert detok.stop_reason is None or stops
    return detok.text, detok.stop_reason, pieces


# -- properties ------------------------------------------------------------------------------------------

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHUNK_SIZES = st.lists(st.integers(1, 6), min_size=1, max_size=8)
ALPHABET = sorted(set("".join(CORPUS) + MULTILINGUAL + "\x00\t€Ωж🤖"))


def token_lists(vocab: int, pool: Sequence[int] = ()) -> st.SearchStrategy[list[int]]:
    token = st.integers(0, vocab - 1)
    if pool:
        token = st.one_of(token, st.sampled_from(list(pool)))
    return st.lists(token, min_size=0, max_size=60)


def well_formed_ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    """Token ids that spell valid text: encoded pieces of text, with special tokens between them.

    A byte-fallback decoder turns a whole run of byte tokens into U+FFFD when the run is not valid UTF-8,
    even its complete characters, so arbitrary ids could make decode() rewrite text already streamed; a
    model's byte tokens that form valid UTF-8 never do.
    """
    specials = [tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")]
    piece = st.one_of(
        st.text(alphabet=ALPHABET, min_size=1, max_size=6).map(lambda text: tokenizer.encode(text).ids),
        st.sampled_from(specials).map(lambda special: [special]),
    )
    return st.lists(piece, max_size=12).map(lambda pieces: [i for ids in pieces for i in ids])


def id_strategy(name: str, tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    if name == "sentencepiece":
        return well_formed_ids(tokenizer)
    return token_lists(vocab_size(tokenizer), tokenizer.encode(MULTILINGUAL).ids)


@pytest.mark.parametrize("name", ["byte_bpe", "sentencepiece"])
def test_emitted_text_equals_full_decode(name: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(name)

    @PROPERTY_SETTINGS
    @given(ids=id_strategy(name, tokenizer), sizes=CHUNK_SIZES, skip=st.booleans())
    def check(ids: list[int], sizes: list[int], skip: bool) -> None:
        text, reason, _ = stream(tokenizer, ids, split(ids, sizes), skip=skip)
        assert text == decode(tokenizer, ids, skip)
        assert reason is None

    check()


@pytest.mark.parametrize("name", ["byte_bpe", "sentencepiece"])
def test_stop_strings_match_a_character_stream(name: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(name)

    @PROPERTY_SETTINGS
    @given(
        ids=id_strategy(name, tokenizer),
        sizes=CHUNK_SIZES,
        cuts=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 6)), min_size=1, max_size=3),
        extra=st.lists(st.text(min_size=1, max_size=4), max_size=2),
    )
    def check(ids: list[int], sizes: list[int], cuts: list[tuple[int, int]], extra: list[str]) -> None:
        full = decode(tokenizer, ids)
        # Stop strings cut out of the text (so they usually occur), plus arbitrary ones.
        stops = [full[start % len(full) :][:length] for start, length in cuts] if full else []
        stops = [s for s in stops if s] + extra
        if not stops:
            return
        text, reason, _ = stream(tokenizer, ids, split(ids, sizes), stops=stops)
        assert (text, reason) == expected_output(full, stops)

    check()


@pytest.mark.slow
def test_default_model_tokenizer_properties(smollm2) -> None:  # type: ignore[no-untyped-def]
    pool = encode(smollm2, MULTILINGUAL)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        ids=token_lists(len(smollm2), pool),
        sizes=CHUNK_SIZES,
        skip=st.booleans(),
        cut=st.tuples(st.integers(0, 400), st.integers(1, 5)),
    )
    def check(ids: list[int], sizes: list[int], skip: bool, cut: tuple[int, int]) -> None:
        full = decode(smollm2, ids, skip)
        text, _, _ = stream(smollm2, ids, split(ids, sizes), skip=skip)
        assert text == full
        if full:
            stop = full[cut[0] % len(full) :][: cut[1]]
            text, reason, _ = stream(smollm2, ids, split(ids, sizes), stops=[stop], skip=skip)
            assert (text, reason) == expected_output(full, [stop])

    check()


# -- UTF-8 -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["byte_bpe", "sentencepiece", pytest.param("smollm2", marks=pytest.mark.slow)]
)
def test_split_characters_are_held_until_complete(name: str, request: pytest.FixtureRequest) -> None:
    tokenizer = request.getfixturevalue(name)
    ids = encode(tokenizer, MULTILINGUAL)
    # The test means something only if some tokens really end inside a character.
    assert any("\ufffd" in decode(tokenizer, [i]) for i in ids)
    text, _, pieces = stream(tokenizer, ids, [[i] for i in ids])
    assert text == MULTILINGUAL
    assert all("\ufffd" not in piece for piece in pieces)


def test_emoji_comes_out_whole(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("ok 😀").ids
    emoji_ids = byte_bpe.encode("😀").ids
    assert len(emoji_ids) > 1  # split across tokens
    detok = IncrementalDetokenizer(byte_bpe, [])
    pieces = [detok.add([i])[0] for i in ids]
    assert pieces[-1].endswith("😀")
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces[: -len(emoji_ids) + 1]) in ("ok ", "ok")


def test_flush_releases_an_incomplete_character_as_decode_shows_it(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("ok 😀").ids[:-1]  # the emoji's last byte never arrives
    detok = IncrementalDetokenizer(byte_bpe, [])
    emitted = "".join(detok.add([i])[0] for i in ids)
    assert "\ufffd" not in emitted
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert detok.text == byte_bpe.decode(ids)
    with pytest.raises(DetokenizerFinishedError, match="flush"):
        detok.add([1])
    assert detok.flush() == ""


# -- leading spaces --------------------------------------------------------------------------------------


def test_sentencepiece_spaces_match_full_decode(sentencepiece: Tokenizer) -> None:
    ids = sentencepiece.encode("Hello world and the dog").ids
    assert sentencepiece.id_to_token(ids[0]).startswith("▁")
    for sizes in ([1], [2], [3, 1], [len(ids)]):
        text, _, pieces = stream(sentencepiece, ids, split(ids, sizes))
        assert text == "Hello world and the dog"
    # Tokens decoded one by one would lose every leading space; the window keeps them.
    text, _, pieces = stream(sentencepiece, ids, [[i] for i in ids])
    assert " " in "".join(pieces[1:])


@pytest.mark.slow
def test_default_model_spaces(smollm2) -> None:  # type: ignore[no-untyped-def]
    sentence = " The quick brown fox, the lazy dog."
    ids = encode(smollm2, sentence)
    text, _, _ = stream(smollm2, ids, [[i] for i in ids])
    assert text == sentence


# -- stop strings ----------------------------------------------------------------------------------------


def test_stop_string_spanning_tokens(byte_bpe: Tokenizer) -> None:
    sentence = "Hello world! The quick brown fox jumps over the lazy dog."
    ids = byte_bpe.encode(sentence).ids
    stop = "ld! The q"
    assert not any(stop in byte_bpe.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(byte_bpe, [], stop=[stop])
    pieces = []
    for i in ids:
        piece, stopped = detok.add([i])
        pieces.append(piece)
        if stopped:
            break
    assert stopped
    assert detok.text == "Hello wor" == "".join(pieces)
    assert detok.stop_reason == stop
    with pytest.raises(DetokenizerFinishedError, match="stop string"):
        detok.add([ids[-1]])
    assert detok.flush() == ""


def test_stop_found_inside_one_chunk_discards_the_rest(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("abc STOP and more text").ids
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["STOP"])
    assert detok.add(ids) == ("abc ", True)
    assert detok.text == "abc "


def test_possible_stop_prefix_is_held_then_released(byte_bpe: Tokenizer) -> None:
    first = byte_bpe.encode("Hello wor").ids
    second = byte_bpe.encode("ld?").ids
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["world!"])
    assert detok.add(first) == ("Hello ", False)  # "wor" could start "world!"
    assert detok.add(second) == ("world?", False)
    assert detok.flush() == ""
    assert detok.text == "Hello world?"


def test_flush_releases_held_stop_prefix(byte_bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["world!", "xyz"])
    assert detok.add(byte_bpe.encode("Hello wor").ids) == ("Hello ", False)
    assert detok.flush() == "wor"
    assert detok.text == "Hello wor"
    assert detok.stop_reason is None


def test_stop_text_without_possible_match_is_not_held(byte_bpe: Tokenizer) -> None:
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["\n\nUser:"])
    assert detok.add(byte_bpe.encode("The quick brown fox").ids) == ("The quick brown fox", False)


def test_first_ending_stop_wins(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode("The quick brown fox").ids
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["brown fox", "quick"])
    assert detok.add(ids) == ("The ", True)
    assert detok.stop_reason == "quick"
    # "quick brown fox" starts first but "brown" ends first: a token-by-token stream sees "brown" first.
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["quick brown fox", "brown"])
    assert detok.add(ids) == ("The quick ", True)
    assert detok.stop_reason == "brown"
    # Same end: the longer one (starting first) wins, so less text is emitted.
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["own", "quick brown"])
    assert detok.add(ids) == ("The ", True)
    assert detok.stop_reason == "quick brown"


def test_stop_strings_in_the_prompt_do_not_count(byte_bpe: Tokenizer) -> None:
    prompt = byte_bpe.encode("say STOP now").ids
    detok = IncrementalDetokenizer(byte_bpe, prompt, stop=["STOP"])
    assert detok.add(byte_bpe.encode("fine").ids) == ("fine", False)


def test_special_tokens(byte_bpe: Tokenizer) -> None:
    special = byte_bpe.token_to_id("<|endoftext|>")
    ids = byte_bpe.encode("Hi").ids + [special] + byte_bpe.encode(" you").ids
    assert stream(byte_bpe, ids, [[i] for i in ids])[0] == "Hi you"
    assert stream(byte_bpe, ids, [[i] for i in ids], skip=False)[0] == "Hi<|endoftext|> you"
    # A special token alone emits nothing (and empty adds are fine).
    detok = IncrementalDetokenizer(byte_bpe, [])
    assert detok.add([special]) == ("", False)
    assert detok.add([]) == ("", False)


def test_invalid_stop_arguments(byte_bpe: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(byte_bpe, [], stop=[""])
    with pytest.raises(TypeError, match="single string"):
        IncrementalDetokenizer(byte_bpe, [], stop="STOP")


# -- cost ------------------------------------------------------------------------------------------------


class RecordingTokenizer:
    """The real tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def test_each_add_decodes_a_small_window(byte_bpe: Tokenizer) -> None:
    ids = byte_bpe.encode(" ".join(CORPUS)).ids
    assert len(ids) > 500
    recorder = RecordingTokenizer(byte_bpe)
    detok = IncrementalDetokenizer(recorder, [], stop=["never appears"])
    for i in ids:
        detok.add([i])
    detok.flush()
    assert detok.text == byte_bpe.decode(ids)
    # Emoji and CJK characters span up to 4 byte tokens here, so windows stay around 8 tokens.
    assert max(recorder.lengths) <= 10

"""Text <-> token ids, and chat prompts, on top of the Rust `tokenizers` library.

`Tokenizer` wraps a ready `tokenizers` backend with the model's special tokens, the ids that end
generation (`eos_token_ids`) and its chat template; it knows no file format. Building one from a file is
the loader's job: `baton.loader.load_tokenizer(path)`, or per format `baton.loader.gguf.tokenizer_from_gguf`
(GGUF `tokenizer.*` metadata) and `baton.loader.hf.tokenizer_from_hf_folder` (tokenizer.json and friends).
This module imports nothing from baton.loader. Every tokenizer offers `encode`/`decode` and
`apply_chat_template`, which renders the model's Jinja chat template in a sandbox the way transformers does.

BOS/EOS are added here, in Python, rather than by a `tokenizers` post-processor, so `encode_chat` can
avoid a second BOS when the chat template already wrote one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders

from baton.api.errors import shown

__all__ = ["CHAT_ROLES", "END_OF_TURN_TOKENS", "Tokenizer", "TokenizerError"]

# Tokens that end an assistant turn in common chat formats; whichever of them a vocabulary has joins
# the EOS set, because GGUF files often name only one id (sometimes the wrong one).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
                      "<end_of_turn>")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> byte: printable bytes stand for themselves, the other 68
    (controls, space, a few Latin-1 ones) take the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()


class TokenizerError(ValueError):
    """The tokenizer cannot be built or cannot do what was asked; the message says why."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' `{% generation %}...{% endgeneration %}` (training-mask markers) as a no-op."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's built-in filter, no HTML escaping: prompts are not HTML.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"the model's chat template does not compile: {e}") from e


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise TokenizerError("messages is empty; a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise TokenizerError(
                f"message {i} has role {shown(role)}; allowed roles are {', '.join(sorted(CHAT_ROLES))}"
            )
        if not isinstance(message.get("content"), str):
            raise TokenizerError(
                f"message {i} ({role}) needs a string 'content', got {type(message.get('content')).__name__}"
            )


class Tokenizer:
    """A model's tokenizer: ids <-> text, end-of-generation ids, and its chat template."""

    vocab_size: int  # ids are 0 .. vocab_size - 1 (may be fewer than the model's embedding rows)
    bos_token_id: int | None
    eos_token_id: int | None  # the file's own EOS, the template's `eos_token`
    eos_token_ids: frozenset[int]  # every id that ends generation
    special_token_ids: frozenset[int]  # skipped by decode(skip_special_tokens=True)
    add_bos: bool
    add_eos: bool
    chat_template: str | None

    def __init__(
        self,
        backend: _Backend,
        *,
        vocab_size: int,
        bos_token_id: int | None,
        eos_token_id: int | None,
        eos_token_ids: frozenset[int],
        special_token_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool = False,
        chat_template: str | None = None,
    ) -> None:
        if vocab_size <= 0:
            raise TokenizerError(f"vocab_size must be positive, got {vocab_size}")
        for label, ids in (("eos_token_ids", eos_token_ids), ("special_token_ids", special_token_ids)):
            bad = sorted(i for i in ids if not 0 <= i < vocab_size)
            if bad:
                raise TokenizerError(f"{label} {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        for label, tid in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tid is not None and not 0 <= tid < vocab_size:
                raise TokenizerError(f"{label} {tid} is outside the vocabulary [0, {vocab_size})")
        if add_bos and bos_token_id is None:
            raise TokenizerError("the tokenizer asks for a BOS token but names no bos_token_id")
        if add_eos and eos_token_id is None:
            raise TokenizerError("the tokenizer asks for an EOS token but names no eos_token_id")
        if not eos_token_ids:
            raise TokenizerError("the tokenizer has no end-of-sequence token; generation could never stop")
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.special_token_ids = frozenset(special_token_ids) | self.eos_token_ids | (
            frozenset() if bos_token_id is None else frozenset({bos_token_id})
        )
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    def state(self) -> dict[str, Any]:
        """Everything this tokenizer is, as plain values (the backend as its JSON): ``from_state`` rebuilds it."""
        return {"backend": self._backend.to_str(), "vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "eos_token_ids": sorted(self.eos_token_ids),
                "special_token_ids": sorted(self.special_token_ids), "add_bos": self.add_bos, "add_eos": self.add_eos,
                "chat_template": self.chat_template}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Tokenizer:
        """The tokenizer that ``state()`` described."""
        fields = dict(state)
        try:
            backend = _Backend.from_str(fields.pop("backend"))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception
            raise TokenizerError(f"the saved tokenizer does not load: {e}") from e
        return cls(backend, **{**fields, "eos_token_ids": frozenset(fields["eos_token_ids"]),
                               "special_token_ids": frozenset(fields["special_token_ids"])})

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={sorted(self.eos_token_ids)}, add_bos={self.add_bos}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # ---- ids <-> text -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; with add_special_tokens, BOS (and EOS) when the model asks for them.

        Special tokens written in the text (e.g. "<|im_start|>") become their single id.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                assert self.bos_token_id is not None
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                assert self.eos_token_id is not None
                ids.append(self.eos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids`; special tokens are left out when skip_special_tokens."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if skip_special_tokens:
            # The backend skips only tokens it knows as special; our set may be wider (e.g. a BOS the
            # file did not mark as control).
            ids = [i for i in ids if i not in self.special_token_ids]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, special tokens as their text. A token may hold part of a UTF-8
        character, which ``decode([token_id])`` would show as U+FFFD."""
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        piece = self._backend.id_to_token(token_id) or ""
        if token_id in self.special_token_ids:
            return piece.encode()
        byte = _BYTE_PIECE.fullmatch(piece)  # SentencePiece's byte fallback: <0xE2>
        if byte:
            return bytes([int(byte.group(1), 16)])
        if isinstance(self._backend.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece writes a space as U+2581

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------------------

    @property
    def chat_tools(self) -> bool:
        """Whether the chat template renders the ``tools`` a request offers (a template that never reads
        the variable would silently drop them)."""
        return self.chat_template is not None and re.search(r"\btools\b", self.chat_template) is not None

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text for a conversation, rendered with the model's chat template; ``tools`` (OpenAI
        tool definitions) are given to the template as ``tools`` when it renders them."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template, so it cannot take chat messages; send a plain prompt instead"
            )
        _check_messages(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        token = self._backend.id_to_token
        extra = {}
        if tools is not None:
            if not self.chat_tools:
                raise TokenizerError("this model's chat template does not render tools")
            extra["tools"] = tools
        try:
            return self._template.render(
                **extra,
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=token(self.eos_token_id) if self.eos_token_id is not None else "",
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template rejected these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS when the model uses BOS."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

"""Text <-> token ids, and chat prompts, on top of the Rust `tokenizers` library.

A `Tokenizer` is built either from a GGUF file's `tokenizer.*` metadata (`Tokenizer.from_gguf`) or from
the tokenizer files of a Hugging Face model folder (`Tokenizer.from_hf_folder`). Both give the same
interface: `encode`/`decode`, the ids that end generation (`eos_token_ids`), and `apply_chat_template`,
which renders the model's Jinja chat template in a sandbox the way transformers does.

BOS/EOS are added here, in Python, rather than by a `tokenizers` post-processor, so `encode_chat` can
avoid a second BOS when the chat template already wrote one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

__all__ = ["CHAT_ROLES", "END_OF_TURN_TOKENS", "Tokenizer", "TokenizerError"]

# Tokens that end an assistant turn in common chat formats; whichever of them a vocabulary has joins
# the EOS set, because GGUF files often name only one id (sometimes the wrong one).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",
                      "<end_of_turn>")
CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# llama.cpp's token_type values (gguf.TokenType).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# Pre-tokenizer split patterns, by the name llama.cpp writes to tokenizer.ggml.pre.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3", "llama-v3", "qwen2")


class TokenizerError(ValueError):
    """The tokenizer cannot be built or cannot do what was asked; the message says why."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 stand for themselves; the others (controls, space, ...) are
    moved, in order, to code points 256, 257, ...
    """
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


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
                f"message {i} has role {role!r}; allowed roles are {', '.join(sorted(CHAT_ROLES))}"
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

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation, rendered with the model's chat template."""
        if self.chat_template is None:
            raise TokenizerError(
                "this model has no chat template, so it cannot take chat messages; send a plain prompt instead"
            )
        _check_messages(messages)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        token = self._backend.id_to_token
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=token(self.bos_token_id) if self.bos_token_id is not None else "",
                eos_token=token(self.eos_token_id) if self.eos_token_id is not None else "",
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template rejected these messages: {e}") from e

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation, with exactly one BOS when the model uses BOS."""
        ids = self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids.insert(0, self.bos_token_id)
        return ids

    # ---- construction --------------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source: Mapping[str, Any] | str | os.PathLike[str] | Any) -> Tokenizer:
        """Build from GGUF metadata: a dict of plain values ({"tokenizer.ggml.tokens": [...], ...}, as
        baton.loader.gguf.read_gguf_metadata returns), a gguf.GGUFReader, or a .gguf path.

        Supports tokenizer.ggml.model "gpt2" (byte-level BPE) with the pre-tokenizers in
        GGUF_PRE_TOKENIZERS.
        """
        if isinstance(source, Mapping):
            fields = source
        else:
            from baton.loader.gguf import read_gguf_metadata, reader_metadata

            fields = (read_gguf_metadata(source) if isinstance(source, (str, os.PathLike))
                      else reader_metadata(source))
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {model!r} is not supported; Baton reads byte-level BPE ('gpt2') vocabularies"
            )
        tokens = fields.get("tokenizer.ggml.tokens")
        merges = fields.get("tokenizer.ggml.merges")
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        if merges is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.merges, which a BPE vocabulary needs")
        n = len(tokens)
        token_types = list(fields.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * n)
        if len(token_types) != n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(token_types)} entries for {n} tokens")
        pre = fields.get("tokenizer.ggml.pre", "default")

        # Normal tokens are spelled in the byte alphabet; one that is not (a mislabelled added token)
        # is respelled from its UTF-8 bytes. Added tokens keep their text: it is what they match.
        alphabet = _byte_alphabet()
        spelled = set(alphabet.values())
        vocab: dict[str, int] = {}
        added: list[AddedToken] = []
        control: set[int] = set()
        for i, (tok, ttype) in enumerate(zip(tokens, token_types)):
            if ttype in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED):
                added.append(AddedToken(tok, special=ttype == _TOKEN_CONTROL, normalized=False))
                if ttype == _TOKEN_CONTROL:
                    control.add(i)
            elif not set(tok) <= spelled:
                tok = "".join(alphabet[b] for b in tok.encode("utf-8"))
            vocab.setdefault(tok, i)  # a duplicate spelling keeps its first id
        pairs = []
        for m in merges:
            left, sep, right = m.partition(" ")
            if not sep:
                raise TokenizerError(f"GGUF merge {m!r} is not two tokens separated by a space")
            pairs.append((left, right))

        normalizer, pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(pre)
        backend = _Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges, fuse_unk=False,
                                      byte_fallback=False))
        if normalizer is not None:
            backend.normalizer = normalizer
        backend.pre_tokenizer = pre_tokenizer
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])

        def tid(key: str) -> int | None:
            value = fields.get(key)
            if value is None:
                return None
            value = int(value)
            if not 0 <= value < n:
                raise TokenizerError(f"{key} = {value} is outside the vocabulary of {n} tokens")
            return value

        bos = tid("tokenizer.ggml.bos_token_id")
        eos = tid("tokenizer.ggml.eos_token_id")
        eos_ids = {i for i in (eos, tid("tokenizer.ggml.eot_token_id"), tid("tokenizer.ggml.eom_token_id"))
                   if i is not None}
        eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        template = fields.get("tokenizer.chat_template")
        return cls(
            backend,
            vocab_size=n,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=frozenset(eos_ids),
            special_token_ids=frozenset(control),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)) and bos is not None,
            add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)) and eos is not None,
            chat_template=template if isinstance(template, str) and template else None,
        )

    @classmethod
    def from_hf_folder(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from tokenizer.json, tokenizer_config.json, chat_template.jinja and generation_config.json."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerError(f"{path} has no tokenizer.json (Baton reads fast-tokenizer files only)")
        try:
            backend = _Backend.from_file(tok_file)
        except Exception as e:  # the Rust side raises plain Exception on malformed files
            raise TokenizerError(f"{tok_file} is not a valid tokenizer file: {e}") from e
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gcfg = _read_json(os.path.join(path, "generation_config.json"))
        mcfg = _read_json(os.path.join(path, "config.json"))
        vocab_size = backend.get_vocab_size(with_added_tokens=True)

        def token_id(value: Any, where: str) -> int | None:
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                return None
            if not isinstance(value, str):
                raise TokenizerError(f"{where} should be a token string, got {value!r}")
            tid = backend.token_to_id(value)
            if tid is None:
                raise TokenizerError(f"{where} {value!r} is not in the vocabulary of {path}")
            return tid

        def int_ids(value: Any) -> list[int]:
            if value is None:
                return []
            return [int(v) for v in (value if isinstance(value, list) else [value])]

        bos = token_id(tcfg.get("bos_token"), "tokenizer_config.json bos_token")
        if bos is None:
            bos = next(iter(int_ids(gcfg.get("bos_token_id")) or int_ids(mcfg.get("bos_token_id"))), None)
        eos = token_id(tcfg.get("eos_token"), "tokenizer_config.json eos_token")
        extra_eos = int_ids(gcfg.get("eos_token_id")) or int_ids(mcfg.get("eos_token_id"))
        if eos is None and extra_eos:
            eos = extra_eos[0]
        vocab = backend.get_vocab(with_added_tokens=True)
        eos_ids = {i for i in [eos, *extra_eos] if i is not None}
        eos_ids |= {vocab[t] for t in END_OF_TURN_TOKENS if t in vocab}
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

        # Does the model want BOS/EOS around a plain encode? tokenizer_config says so explicitly in
        # most models; otherwise ask tokenizer.json's post-processor.
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe_full = backend.encode("a", add_special_tokens=True).ids
        add_bos = tcfg.get("add_bos_token")
        if add_bos is None:
            add_bos = bos is not None and len(probe_full) > len(probe_plain) and probe_full[0] == bos
        add_eos = tcfg.get("add_eos_token")
        if add_eos is None:
            add_eos = eos is not None and len(probe_full) > len(probe_plain) and probe_full[-1] == eos

        template = tcfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return cls(
            backend,
            vocab_size=vocab_size,
            bos_token_id=bos,
            eos_token_id=eos,
            eos_token_ids=frozenset(eos_ids),
            special_token_ids=frozenset(special),
            add_bos=bool(add_bos) and bos is not None,
            add_eos=bool(add_eos) and eos is not None,
            chat_template=template if isinstance(template, str) and template else None,
        )


def _gguf_pre_tokenizer(pre: str) -> tuple[normalizers.Normalizer | None, pre_tokenizers.PreTokenizer, bool]:
    """(normalizer, pre-tokenizer, BPE ignore_merges) for llama.cpp's tokenizer.ggml.pre name."""
    if pre in ("default", "gpt2"):
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if pre == "smollm":
        # Every digit on its own, then GPT-2's split.
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]), False
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        # Llama 3 looks a whole word up in the vocabulary before merging (ignore_merges).
        return None, pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), True
    if pre == "qwen2":
        return normalizers.NFC(), pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]), False
    raise TokenizerError(
        f"GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
        f"Baton knows {', '.join(GGUF_PRE_TOKENIZERS)}"
    )


def _read_json(file: str) -> dict[str, Any]:
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {file}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{file} should hold a JSON object, got {type(data).__name__}")
    return data

"""Text <-> token ids, and chat prompts rendered with the model's own template.

One class serves both checkpoint kinds: a Hugging Face directory brings a ready ``tokenizer.json``;
a GGUF file only has a vocabulary, merges and token types in its metadata, from which
``Tokenizer.from_byte_level_bpe`` rebuilds an equivalent ``tokenizers.Tokenizer``. Everything else
in jitney (detokenizer, server, offline API) depends only on this class.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors


class TokenizerError(ValueError):
    """A tokenizer that cannot be built, or a chat template that cannot be rendered."""


# Pre-tokenizer split rules of llama.cpp's ``tokenizer.ggml.pre`` names. The merges of a byte-level
# vocabulary were learned on text split this way, so using another split changes the ids.
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_FIRST_PRE = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"})
_QWEN2_PRE = frozenset({"qwen2", "deepseek-r1-qwen", "megrez"})
_GPT2_PRE = frozenset({"default", "gpt2", "gpt-2", "mpt", "olmo", "jais"})
KNOWN_PRE_TOKENIZERS = _DIGIT_FIRST_PRE | _LLAMA3_PRE | _QWEN2_PRE | _GPT2_PRE

# llama.cpp token types (``tokenizer.ggml.token_type``).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a llama.cpp pre-tokenizer name stands for, followed by the byte-to-unicode mapping."""
    if pre in _DIGIT_FIRST_PRE:
        split = [pre_tokenizers.Digits(individual_digits=True)]
        regex = _GPT2_SPLIT
    elif pre in _LLAMA3_PRE:
        split, regex = [], _LLAMA3_SPLIT
    elif pre in _QWEN2_PRE:
        split, regex = [], _QWEN2_SPLIT
    elif pre in _GPT2_PRE:
        split, regex = [], _GPT2_SPLIT
    else:
        raise TokenizerError(
            f"unknown byte-level pre-tokenizer {pre!r}; known: {', '.join(sorted(KNOWN_PRE_TOKENIZERS))}"
        )
    return pre_tokenizers.Sequence(
        [
            *split,
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@dataclass
class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what HF keeps beside it (special tokens, chat template).

    ``eos_token_ids`` holds every id that ends generation: the tokenizer's EOS and any extra ids
    listed in ``generation_config.json`` (Llama 3 instruct models stop on two).
    """

    backend: tokenizers.Tokenizer
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    extra_eos_token_ids: tuple[int, ...] = ()
    special_tokens: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """The tokenizer of a checkpoint directory or of a ``.gguf`` file (no weights are read)."""
        target = Path(path)
        if target.is_file() and target.suffix.lower() == ".gguf":
            from jitney.model.gguf import load_gguf_tokenizer

            return load_gguf_tokenizer(target)
        if target.is_dir():
            return cls.from_directory(target)
        raise TokenizerError(f"{target} is neither a checkpoint directory nor a .gguf file")

    @classmethod
    def from_directory(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and the settings HF stores next to it."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"no tokenizer.json in {root} (only fast-tokenizer checkpoints are supported)"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception on a malformed file
            raise TokenizerError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json")
        template = _chat_template_from(root, config)
        special = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if _token_text(config.get(name)) is not None
        }
        extra_eos = _ids_from(_read_json(root / "generation_config.json").get("eos_token_id"))
        tokenizer = cls(
            backend=backend,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            unk_token=special.get("unk_token"),
            pad_token=special.get("pad_token"),
            chat_template=template,
            extra_eos_token_ids=extra_eos,
            special_tokens=special,
        )
        tokenizer._check_special_tokens()
        return tokenizer

    @classmethod
    def from_byte_level_bpe(
        cls,
        tokens: Sequence[str],
        merges: Sequence[str],
        *,
        token_types: Sequence[int] | None = None,
        pre_tokenizer: str = "default",
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        unk_token_id: int | None = None,
        pad_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> Tokenizer:
        """Rebuild a GPT-2 style tokenizer from a raw vocabulary (what a GGUF file stores).

        Control tokens become special added tokens (matched whole in text, dropped by
        ``skip_special_tokens``); user-defined ones become plain added tokens.
        """
        if token_types is not None and len(token_types) != len(tokens):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        vocab = {token: index for index, token in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise TokenizerError("the vocabulary lists the same token twice")
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise TokenizerError(f"malformed merge {merge!r} (expected two tokens separated by a space)")
            pairs.append((left, right))
        backend = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
        )
        backend.pre_tokenizer = byte_level_pre_tokenizer(pre_tokenizer)
        backend.decoder = decoders.ByteLevel()
        added = []
        for token, kind in zip(tokens, token_types or (), strict=False):
            if kind == TOKEN_TYPE_CONTROL:
                added.append(AddedToken(token, special=True, normalized=False))
            elif kind == TOKEN_TYPE_USER_DEFINED:
                added.append(AddedToken(token, special=False, normalized=False))
        special_ids = {i for i in (bos_token_id, eos_token_id, unk_token_id, pad_token_id) if i is not None}
        for index in sorted(special_ids):
            if not 0 <= index < len(tokens):
                raise TokenizerError(f"special token id {index} is outside the vocabulary of {len(tokens)}")
            if not token_types or token_types[index] != TOKEN_TYPE_CONTROL:
                added.append(AddedToken(tokens[index], special=True, normalized=False))
        backend.add_tokens(added)

        def text(index: int | None) -> str | None:
            return tokens[index] if index is not None else None

        if add_bos_token and bos_token_id is not None:
            bos = tokens[bos_token_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)]
            )
        special = {
            name: value
            for name, value in (
                ("bos_token", text(bos_token_id)),
                ("eos_token", text(eos_token_id)),
                ("unk_token", text(unk_token_id)),
                ("pad_token", text(pad_token_id)),
            )
            if value is not None
        }
        return cls(
            backend=backend,
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            unk_token=special.get("unk_token"),
            pad_token=special.get("pad_token"),
            chat_template=chat_template,
            extra_eos_token_ids=tuple(extra_eos_token_ids),
            special_tokens=special,
        )

    def _check_special_tokens(self) -> None:
        for name, text in self.special_tokens.items():
            if self.backend.token_to_id(text) is None:
                raise TokenizerError(f"{name} {text!r} is not in the vocabulary")

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.backend.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (the one a request carries to the scheduler)."""
        if self.eos_token is not None:
            return self.backend.token_to_id(self.eos_token)
        return self.extra_eos_token_ids[0] if self.extra_eos_token_ids else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation, primary first, without duplicates."""
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        ids += [i for i in self.extra_eos_token_ids if i not in ids]
        return tuple(ids)

    @property
    def all_special_ids(self) -> frozenset[int]:
        decoder = self.backend.get_added_tokens_decoder()
        return frozenset(index for index, token in decoder.items() if token.special)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of ``text``; special-token text inside it (e.g. ``<|im_start|>``) maps to its id."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render a conversation into the prompt text the model was trained on.

        The rendered text already contains the special tokens the template writes (BOS included,
        if the template writes it), so ``tokenize=True`` encodes it without adding any.
        """
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template; send a plain prompt instead")
        _check_messages(messages)
        text = render_chat_template(
            self.chat_template,
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **self.special_tokens,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _check_messages(messages: Sequence[dict[str, Any]]) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise TokenizerError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TokenizerError(f"messages[{index}] must be a dict with a string 'role'")


# ---------------------------------------------------------------------- chat templates
def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # HF's own filter: unlike jinja's built-in it keeps non-ASCII text and does not HTML-escape.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment():
    """A sandboxed jinja environment configured like transformers' (trim/lstrip blocks)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def render_chat_template(template: str, **variables: Any) -> str:
    """Render ``template`` with HF's variables (messages, add_generation_prompt, bos_token, ...)."""
    import jinja2

    try:
        compiled = _template_environment().from_string(template)
        return compiled.render(**variables)
    except TokenizerError:
        raise
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template error: {exc}") from exc


# ---------------------------------------------------------------------- HF files
def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """HF writes special tokens either as text or as a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids_from(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list):
        return tuple(v for v in value if isinstance(v, int))
    return ()


def _chat_template_from(root: Path, config: dict[str, Any]) -> str | None:
    """Newer checkpoints keep the template in ``chat_template.jinja``; older ones in the config."""
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None

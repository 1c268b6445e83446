"""The Tokenizer wrapper: HF directories, vocabularies rebuilt from raw tokens, chat templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tokenizers

from jitney.tokenizer import Tokenizer, TokenizerError, byte_level_pre_tokenizer, render_chat_template

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Grüße aus Köln! Привет, мир. 🚀🙂", "  x\n\ty  "]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture()
def copy_of(checkpoint, tmp_path):
    def make() -> Path:
        target = tmp_path / "ckpt"
        shutil.copytree(checkpoint, target)
        return target

    return make


def test_directory_tokenizer_encodes_like_tokenizer_json(checkpoint):
    tok = Tokenizer.from_directory(checkpoint)
    raw = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == raw.encode(text).ids
        assert tok.decode(ids) == text
    assert tok.eos_token == "<|endoftext|>"
    assert tok.eos_token_id == raw.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == (tok.eos_token_id,)
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)


def test_special_tokens_in_text_are_single_ids_and_skippable(checkpoint):
    tok = Tokenizer.from_directory(checkpoint)
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>")
    assert ids[0] == start and ids[-1] == end
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhello"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhello<|im_end|>"
    assert {start, end, tok.eos_token_id} <= tok.all_special_ids


def test_chat_template_renders_like_transformers(checkpoint):
    from transformers import AutoTokenizer

    ours = Tokenizer.from_directory(checkpoint)
    reference = AutoTokenizer.from_pretrained(str(checkpoint))
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt) == expected
    ids = ours.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids == ours.encode(ours.apply_chat_template(CONVERSATION), add_special_tokens=False)


def test_generation_config_adds_eos_ids(copy_of):
    path = copy_of()
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 0, 9]}))
    tok = Tokenizer.from_directory(path)
    assert tok.eos_token_id == 0  # the tokenizer's own EOS stays primary
    assert tok.eos_token_ids == (0, 7, 9)


def test_chat_template_file_and_hf_helpers(copy_of):
    path = copy_of()
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "[{{ m['role'] }}|{{ m['content'] | tojson }}]{% endfor %}"
        "{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    tok = Tokenizer.from_directory(path)
    rendered = tok.apply_chat_template([{"role": "user", "content": "Ça «va»"}])
    assert rendered == '[user|"Ça «va»"]<|endoftext|>'
    with pytest.raises(TokenizerError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_templates_are_sandboxed():
    with pytest.raises(TokenizerError, match="chat template error"):
        render_chat_template("{{ messages.__class__.__mro__ }}", messages=[])
    with pytest.raises(TokenizerError, match="chat template error"):
        render_chat_template("{% for %}", messages=[])
    # HF templates rely on these being present.
    rendered = render_chat_template(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m }}{% endfor %}"
        "{{ strftime_now('%Y') | length }}",
        messages=["a", "b"],
    )
    assert rendered == "a4"


def test_bad_inputs_get_clear_errors(checkpoint, tmp_path, copy_of):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_directory(tmp_path)
    tok = Tokenizer.from_directory(checkpoint)
    with pytest.raises(TokenizerError, match="non-empty list"):
        tok.apply_chat_template([])
    with pytest.raises(TokenizerError, match=r"messages\[1\]"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(TypeError):
        tok.encode(["not", "a", "string"])  # type: ignore[arg-type]
    path = copy_of()
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    config["eos_token"] = "<|not-in-vocab|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_directory(path)
    config["eos_token"] = "<|endoftext|>"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_directory(path).apply_chat_template([{"role": "user", "content": "hi"}])


def _raw_vocabulary(checkpoint: Path) -> tuple[list[str], list[str]]:
    data = json.loads((checkpoint / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges


def test_rebuilt_byte_level_bpe_matches_the_original(checkpoint):
    tokens, merges = _raw_vocabulary(checkpoint)
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    eos = tokens.index("<|endoftext|>")
    rebuilt = Tokenizer.from_byte_level_bpe(tokens, merges, token_types=types, pre_tokenizer="gpt2",
                                            eos_token_id=eos, bos_token_id=eos, add_bos_token=True)
    original = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in [*TEXTS, "<|im_start|>assistant\nok<|im_end|>"]:
        assert rebuilt.encode(text, add_special_tokens=False) == original.encode(text).ids
        assert rebuilt.encode(text) == [eos, *original.encode(text).ids]  # add_bos_token
    assert rebuilt.eos_token == "<|endoftext|>" and rebuilt.bos_token_id == eos


def test_rebuild_rejects_inconsistent_vocabularies(checkpoint):
    tokens, merges = _raw_vocabulary(checkpoint)
    with pytest.raises(TokenizerError, match="token types"):
        Tokenizer.from_byte_level_bpe(tokens, merges, token_types=[1])
    with pytest.raises(TokenizerError, match="malformed merge"):
        Tokenizer.from_byte_level_bpe(tokens, ["nospace"])
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        Tokenizer.from_byte_level_bpe(tokens, merges, eos_token_id=len(tokens))
    with pytest.raises(TokenizerError, match="unknown byte-level pre-tokenizer 'klingon'"):
        byte_level_pre_tokenizer("klingon")


def test_from_path_picks_the_loader(checkpoint, tmp_path):
    from jitney.model.registry import resolve_model_path

    assert Tokenizer.from_path(checkpoint).encode("fox") == Tokenizer.from_directory(checkpoint).encode("fox")
    gguf_tok = Tokenizer.from_path(resolve_model_path())
    assert gguf_tok.eos_token == "<|im_end|>"
    with pytest.raises(TokenizerError, match="neither"):
        Tokenizer.from_path(tmp_path / "nothing")

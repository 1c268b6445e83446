"""Streaming detokenization: whole characters only, stop strings across token boundaries, O(new)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitney.detokenizer import IncrementalDetokenizer
from jitney.model.gguf import load_gguf_tokenizer
from jitney.model.registry import resolve_model_path
from jitney.tokenizer import Tokenizer

MULTIBYTE = "Xin chào thế giới 🦙🚀 Привет, мир! 日本語 😀👍🏽 ❤️ naïve café"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    # SmolLM2's real byte-level vocabulary: emoji and Vietnamese split across several tokens.
    return load_gguf_tokenizer(resolve_model_path())


def stream(tok: Tokenizer, ids: Sequence[int], chunks: Sequence[int] = (), prompt: Sequence[int] = (),
           **kwargs) -> tuple[list[str], bool, IncrementalDetokenizer]:
    """Feed ``ids`` in pieces of the given sizes (1 when exhausted); return deltas, stop flag, detok."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    deltas, hit, pos, sizes = [], False, 0, list(chunks)
    while pos < len(ids) and not hit:
        size = sizes.pop(0) if sizes else 1
        delta, hit = detok.append(ids[pos : pos + size])
        deltas.append(delta)
        pos += size
    if not hit:
        deltas.append(detok.flush())
    return deltas, hit, detok


def expected_output(text: str, stops: Sequence[str], include: bool) -> tuple[str, bool]:
    """Reference: cut at the stop string whose first occurrence ends first."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, False
    end, start, _ = min(found, key=lambda f: (f[0], f[1]))
    return text[: end if include else start], True


def test_multibyte_characters_split_across_tokens_are_never_broken(tok):
    ids = tok.encode(MULTIBYTE)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the sample must contain characters split across tokens"
    deltas, hit, detok = stream(tok, ids, prompt=tok.encode("Say hello:"))
    assert not hit
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == MULTIBYTE


def test_prompt_is_not_part_of_the_output(tok):
    prompt = tok.encode("<|im_start|>assistant\n")
    deltas, _, detok = stream(tok, tok.encode(" Paris"), prompt=prompt)
    assert detok.text == " Paris"


def test_special_tokens_are_skipped_unless_asked(tok):
    ids = tok.encode("Hi<|im_end|>")
    assert stream(tok, ids)[2].text == "Hi"
    assert stream(tok, ids, skip_special_tokens=False)[2].text == "Hi<|im_end|>"


def test_stop_string_spanning_tokens_is_cut_and_held_back_until_decided(tok):
    text = "The capital of France is Paris. It is lovely."
    ids = tok.encode(text)
    deltas, hit, detok = stream(tok, ids, stop=["Paris."])
    assert hit and detok.text == "The capital of France is "
    assert detok.stop_reason == "Paris."
    # "P" alone could start the stop string: it must never have been released.
    assert all("P" not in d for d in deltas)
    assert detok.append(tok.encode(" more")) == ("", True) and detok.flush() == ""


def test_include_stop_string_in_output(tok):
    ids = tok.encode("one two three four")
    _, hit, detok = stream(tok, ids, stop=["two th"], include_stop_str_in_output=True)
    assert hit and detok.text == "one two th"


def test_held_back_prefix_is_released_when_it_does_not_complete(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["the end"])
    assert detok.append(tok.encode("end of the")) == ("end of ", False)  # "the" may start "the end"
    assert detok.append(tok.encode(" story")) == ("the story", False)
    assert detok.append(tok.encode(" th")) == (" ", False)
    assert detok.flush() == "th"
    assert detok.text == "end of the story th"


def test_stop_found_in_the_middle_of_a_multi_token_append(tok):
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, [], stop=["gamma", "beta"])
    delta, hit = detok.append(ids)
    assert hit and delta == "alpha " and detok.stop_reason == "beta"


def test_invalid_bytes_do_not_stall_the_stream(tok):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    lone_continuation = tok.token_to_id(bytes_to_unicode()[0x80])
    ids = tok.encode("ok ") + [lone_continuation] * 10 + tok.encode(" fine")
    deltas, _, detok = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) and detok.text.startswith("ok \ufffd")
    assert sum(1 for d in deltas[:-1] if "\ufffd" in d) > 0  # released before the end, not only by flush


class _CountingTokenizer:
    """The real tokenizer, recording how many ids each decode call receives."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner, self.largest = inner, 0

    def decode(self, ids, skip_special_tokens=True):
        self.largest = max(self.largest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_work_per_token_does_not_grow_with_the_output(tok):
    counting = _CountingTokenizer(tok)
    ids = tok.encode(MULTIBYTE * 40)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(counting, tok.encode("prompt " * 100), stop=["never appears"])
    for i in ids:
        detok.append([i])
    detok.flush()
    assert detok.text == MULTIBYTE * 40
    assert counting.largest <= 12


_ALPHABET = st.sampled_from(list("abc xyz.,!\n") + ["é", "ớ", "П", "ж", "日", "🦙", "😀", "👍🏽", "ế"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.lists(_ALPHABET, min_size=1, max_size=40).map("".join),
    stop_picks=st.lists(st.tuples(st.integers(0, 39), st.integers(1, 6)), max_size=3),
    extra_stops=st.lists(st.lists(_ALPHABET, min_size=1, max_size=3).map("".join), max_size=2),
    chunks=st.lists(st.integers(1, 4), max_size=30),
    include=st.booleans(),
)
def test_streamed_text_equals_the_reference_cut(tok, text, stop_picks, extra_stops, chunks, include):
    stops = [text[a : a + n] for a, n in stop_picks if text[a : a + n]] + extra_stops
    ids = tok.encode(text)
    deltas, hit, detok = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
    expected, expected_hit = expected_output(tok.decode(ids), stops, include)
    assert hit == expected_hit
    assert "".join(deltas) == detok.text == expected
    assert all("\ufffd" not in d for d in deltas)


def test_sentencepiece_style_spaces_survive_streaming():
    # A Metaspace decoder drops the space of the first piece it sees; decoding each token alone
    # would glue the words together.
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = ["hello world, the quick brown fox", "hello there world"] * 5
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"],
                                                            show_progress=False))
    tok = Tokenizer(backend=backend)
    ids = tok.encode("hello world the fox")
    assert "".join(tok.decode([i]) for i in ids) != "hello world the fox"
    deltas, _, detok = stream(tok, ids[2:], prompt=ids[:2])
    assert detok.text == tok.decode(ids)[len(tok.decode(ids[:2])):]
    assert "".join(deltas) == detok.text
    assert detok.text.startswith(" ") and detok.text.endswith(" the fox")

"""The offline API and the generate/demo commands on a tiny real checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jitney import LLM, SamplingParams
from jitney.core.scheduler import AdmissionError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_model_len=512)


def test_outputs_in_input_order_for_text_and_token_prompts(llm: LLM) -> None:
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9, 10, 11, 12], "Paris"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 7, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7, 5]
    assert outs[1].prompt_token_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    assert outs[0].prompt == "The quick brown fox" and outs[1].prompt is None
    assert all(o.finish_reason == "length" for o in outs)
    # The same prompt alone gives the same greedy tokens as inside the batch.
    alone = llm.generate([prompts[1]], params[1], use_tqdm=False)[0]
    assert alone.token_ids == outs[1].token_ids
    for o in outs:
        assert o.metrics.first_token_time is not None and o.metrics.output_tokens == len(o.token_ids)
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_text_matches_tokens_and_seeded_sampling_repeats(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Continuous batching"], params, use_tqdm=False)[0]
    b = llm.generate(["Continuous batching", "something else to batch with"], params, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids
    assert a.text == llm.tokenizer.decode(a.token_ids)


def test_chat_applies_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4))[0]
    expected = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}]), add_special_tokens=False
    )
    assert out.prompt_token_ids == expected


def test_bad_inputs_are_rejected_and_nothing_is_left_queued(llm: LLM) -> None:
    with pytest.raises(AdmissionError, match="exceeds max_model_len 512"):
        llm.generate(["ok", [1] * 600], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 512\)"):
        llm.generate([[1, 2, 99999]], use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv.num_free_blocks == 64


def test_stop_string_ends_the_request_without_the_stop_text(llm: LLM) -> None:
    free = llm.generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False
    )[0]
    stop = free.text[5:8]
    assert stop.strip(), "need a non-blank stop string from the free-running text"
    cut = llm.generate(
        ["The quick brown fox"],
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jitney.cli", *args], capture_output=True, text=True, timeout=180
    )


def test_generate_command_prints_an_answer(tiny_checkpoint) -> None:
    res = run_cli(
        "generate",
        "--model",
        str(tiny_checkpoint("llama")),
        "--max-tokens",
        "5",
        "--dtype",
        "float32",
        "hello",
    )
    assert res.returncode == 0, res.stderr
    assert "5 tokens]" in res.stderr


def test_cli_errors_are_one_line_without_traceback(tmp_path) -> None:
    res = run_cli("generate", "--model", str(tmp_path / "nowhere"), "hello")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "jitney generate: error:" in res.stderr and "not found" in res.stderr

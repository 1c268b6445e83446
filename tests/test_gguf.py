"""GGUF loading checked against transformers' own GGUF loader and against the source weights.

A tiny Llama checkpoint is converted to GGUF here the way llama.cpp's converter does it (Q/K rows
permuted, tensors renamed, one quantization type per tensor), so every supported tensor type and
the permutation are covered in a file small enough to load in well under a second. The bundled
SmolLM2 file is then checked the same way, end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

from jitney.model.gguf import (
    GgufError,
    GgufFile,
    hf_tensor_name,
    load_gguf,
    load_gguf_config,
    load_gguf_tokenizer,
    unpermute_rotary_rows,
)
from jitney.model.registry import resolve_model_path

HEADS, KV_HEADS = 4, 2
TINY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, num_hidden_layers=3)

# One type per tensor so that each supported type (and both Q/K permutations) is exercised.
TENSOR_TYPES = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.F32,
    "blk.0.attn_k.weight": Q.F32,
    "blk.0.attn_v.weight": Q.F16,
    "blk.0.attn_output.weight": Q.BF16,
    "blk.0.ffn_gate.weight": Q.Q8_0,
    "blk.0.ffn_up.weight": Q.Q4_0,
    "blk.0.ffn_down.weight": Q.Q4_1,
    "blk.1.attn_q.weight": Q.Q4_K,
    "blk.1.attn_k.weight": Q.Q6_K,
    "blk.1.attn_v.weight": Q.Q4_K,
    "blk.1.attn_output.weight": Q.Q6_K,
    "blk.1.ffn_gate.weight": Q.Q5_0,
    "blk.1.ffn_up.weight": Q.Q5_1,
    "blk.1.ffn_down.weight": Q.F16,
    "blk.2.attn_q.weight": Q.Q5_K,
    "blk.2.attn_k.weight": Q.Q3_K,
    "blk.2.attn_v.weight": Q.Q2_K,
}
# Block sizes and where the f16 super-block scales sit in each K-quant block.
K_QUANT_BLOCK_BYTES = {Q.Q4_K: 144, Q.Q6_K: 210, Q.Q5_K: 176, Q.Q3_K: 110, Q.Q2_K: 84}
K_QUANT_SCALE_SLOTS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (-2,), Q.Q3_K: (-2,), Q.Q2_K: (-4, -2)}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (pairs the two rotary halves of each head)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _k_quant_blocks(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane scales (gguf-py can read but not write K-quants)."""
    block_bytes = K_QUANT_BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, block_bytes), dtype=np.uint8)
    scale = np.full((blocks.shape[0],), 0.002, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    for start in K_QUANT_SCALE_SLOTS[qtype]:
        blocks[:, start : start + 2 if start != -2 else None] = scale
    return blocks.reshape(rows, cols // 256 * block_bytes)


def _gguf_name(hf_name: str) -> str:
    table = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if hf_name in table:
        return table[hf_name]
    parts = hf_name.split(".")
    layer, module = parts[2], ".".join(parts[3:-1])
    short = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }[module]
    return f"blk.{layer}.{short}.weight"


def write_tiny_gguf(checkpoint: Path, out: Path) -> Path:
    """Convert a tiny HF Llama checkpoint into a GGUF file, tokenizer included."""
    config = json.loads((checkpoint / "config.json").read_text())
    tokenizer_json = json.loads((checkpoint / "tokenizer.json").read_text())
    weights = load_file(str(checkpoint / "model.safetensors"))
    rng = np.random.default_rng(0)

    writer = GGUFWriter(str(out), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])

    vocab = tokenizer_json["model"]["vocab"]
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {t["content"] for t in tokenizer_json["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(json.loads((checkpoint / "tokenizer_config.json").read_text())["chat_template"])

    for hf_name, value in weights.items():
        if hf_name == "lm_head.weight":
            continue  # tied: the GGUF has no output.weight
        name = _gguf_name(hf_name)
        array = value.astype(np.float32)
        if name.endswith("attn_q.weight"):
            array = _llama_cpp_permute(array, HEADS)
        elif name.endswith("attn_k.weight"):
            array = _llama_cpp_permute(array, KV_HEADS)
        qtype = TENSOR_TYPES.get(name, Q.F32)
        if qtype in K_QUANT_BLOCK_BYTES:
            writer.add_tensor(name, _k_quant_blocks(*array.shape, qtype, rng), raw_dtype=qtype)
        elif qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, quantize(array, qtype))
        else:
            writer.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    checkpoint = tiny_checkpoint("llama", tie_word_embeddings=True, **TINY_SHAPE)
    return checkpoint, write_tiny_gguf(checkpoint, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _transformers_state_dict(gguf_path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_tiny_gguf_matches_transformers_weight_for_weight(tiny_gguf):
    _, path = tiny_gguf
    ours = load_gguf(path).tensors
    reference = _transformers_state_dict(path)
    reference.pop("lm_head.weight")  # transformers materialises the tied head; we leave it out
    assert sorted(ours) == sorted(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == reference[name].shape, name
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_tiny_gguf_round_trips_the_source_weights(tiny_gguf):
    checkpoint, path = tiny_gguf
    source = load_file(str(checkpoint / "model.safetensors"))
    ours = load_gguf(path).tensors
    # F32 tensors come back bit-exact: names are right and the Q/K permutation is undone.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.norm.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(ours[name], torch.from_numpy(source[name])), name
    # Quantized ones come back within their quantization error.
    tolerance = {"model.layers.0.self_attn.v_proj.weight": 1e-3,  # F16
                 "model.layers.0.self_attn.o_proj.weight": 4e-3,  # BF16
                 "model.layers.0.mlp.gate_proj.weight": 0.01,  # Q8_0
                 "model.embed_tokens.weight": 0.01,  # Q8_0
                 "model.layers.0.mlp.up_proj.weight": 0.1}  # Q4_0
    for name, atol in tolerance.items():
        torch.testing.assert_close(ours[name], torch.from_numpy(source[name]), rtol=0, atol=atol, msg=name)


def test_tiny_gguf_config_and_tokenizer(tiny_gguf):
    checkpoint, path = tiny_gguf
    hf = json.loads((checkpoint / "config.json").read_text())
    ckpt = load_gguf(path)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert ckpt.config[key] == hf[key], key
    assert ckpt.config["architectures"] == ["LlamaForCausalLM"]
    assert ckpt.config["tie_word_embeddings"] is True
    assert ckpt.config["rms_norm_eps"] == pytest.approx(hf["rms_norm_eps"])
    assert load_gguf_config(path) == ckpt.config

    import tokenizers

    original = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in ["The quick brown fox.", "Grüße, Привет 🚀 <|im_start|>user\nhi<|im_end|>", "  a\n\tb  "]:
        assert ckpt.tokenizer.encode(text) == original.encode(text).ids, text
        assert ckpt.tokenizer.decode(ckpt.tokenizer.encode(text), skip_special_tokens=False) == text
    assert ckpt.tokenizer.eos_token_id == original.token_to_id("<|endoftext|>")
    assert ckpt.generation_config["eos_token_id"] == ckpt.tokenizer.eos_token_id


def test_unpermute_inverts_the_llama_cpp_permutation():
    weight = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_rotary_rows(_llama_cpp_permute(weight, heads), heads), weight)
    with pytest.raises(GgufError, match="heads"):
        unpermute_rotary_rows(weight, 5)


def test_tensor_names_map_to_hf():
    assert hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(GgufError, match="no counterpart"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_bad_files_get_clear_errors(tmp_path):
    with pytest.raises(GgufError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all, just some bytes" * 4)
    with pytest.raises(GgufError, match="not a GGUF file"):
        load_gguf(junk)


def test_truncated_file_is_rejected(tiny_gguf, tmp_path):
    _, path = tiny_gguf
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 1000])
    with pytest.raises(GgufError, match="truncated"):
        load_gguf(cut)


def test_other_architectures_are_refused(tmp_path):
    out = tmp_path / "mamba.gguf"
    writer = GGUFWriter(str(out), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GgufFile.open(out).metadata["general.architecture"] == "mamba"
    with pytest.raises(GgufError, match="unsupported GGUF architecture 'mamba'"):
        load_gguf(out)


# ---------------------------------------------------------------------- the bundled model
@pytest.fixture(scope="module")
def bundled() -> Path:
    return resolve_model_path("smollm2-135m-instruct")


def test_bundled_smollm2_config_and_shapes(bundled):
    ckpt = load_gguf(bundled)
    cfg = ckpt.config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and "lm_head.weight" not in ckpt.tensors
    assert len(ckpt.tensors) == 2 + 9 * 30
    assert ckpt.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert ckpt.tensors["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert torch.isfinite(ckpt.tensors[name]).all(), name
    tok = ckpt.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"] == 2
    assert tok.vocab_size == 49152
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    expected_end = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.endswith(expected_end)


@pytest.mark.slow
def test_bundled_smollm2_weights_match_transformers(bundled):
    ours = load_gguf(bundled).tensors
    reference = _transformers_state_dict(bundled)
    assert set(reference) - set(ours) == {"lm_head.weight"}
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)


def test_bundled_tokenizer_matches_transformers(bundled):
    from transformers import AutoTokenizer

    ours = load_gguf_tokenizer(bundled)
    reference = AutoTokenizer.from_pretrained(str(bundled.parent), gguf_file=bundled.name)
    texts = [
        "What is the capital of France?",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "Emoji: 🦙🚀 😀👍🏽 and ❤️",
        "Xin chào, tôi là người Việt Nam. Hôm nay trời đẹp quá!",
        "Привет, мир! Как у тебя дела? Съешь же ещё этих мягких французских булок.",
        "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
        "Version 2.0.1 released on 2024-11-29 at 12:30, costs $1,299.99",
        "   leading spaces,\ttabs\n\n\nand trailing   ",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_bundled_digits_are_split_one_by_one(bundled):
    # SmolLM2 was trained with single-digit pre-tokenization (llama.cpp pre-tokenizer "smollm").
    tok = load_gguf_tokenizer(bundled)
    pieces = [tok.decode([i]) for i in tok.encode("year 2024")]
    assert pieces[-4:] == ["2", "0", "2", "4"]

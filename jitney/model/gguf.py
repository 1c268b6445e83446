"""Load a llama.cpp GGUF file as if it were a Hugging Face checkpoint.

The rest of jitney only knows HF checkpoints (``config.json`` keys, HF tensor names, a
``tokenizer.json``). Rather than teach every layer about GGUF, this module translates the file once
at load time: metadata -> HF config dict, ``blk.N.attn_q.weight`` -> HF names, quantized blocks ->
dense float32 (with llama.cpp's rotary row interleaving on Q/K undone), and the vocabulary stored
in the metadata -> a ``tokenizers`` tokenizer. After that a GGUF model takes exactly the same path
as a safetensors one.
"""

from __future__ import annotations

import logging
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jitney.tokenizer import KNOWN_PRE_TOKENIZERS, Tokenizer, TokenizerError

logger = logging.getLogger(__name__)


class GgufError(ValueError):
    """A GGUF file jitney cannot load: unreadable, unsupported architecture, tensor type or layout."""


@dataclass
class GgufCheckpoint:
    """Everything a GGUF file holds, already in HF form."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    generation_config: dict[str, Any] = field(default_factory=dict)


# Architectures whose tensors follow the llama layout (and the llama.cpp Q/K permutation).
_HF_ARCHITECTURE = {"llama": "LlamaForCausalLM"}

# Quantization types this loader promises to handle (all dequantized by gguf.quants).
SUPPORTED_TENSOR_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a llama-layout GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3...``)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}"
    raise GgufError(f"tensor {gguf_name!r} has no counterpart in a Llama checkpoint")


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows.

    llama.cpp's converter interleaves the two rotary halves of every head (``permute`` in
    convert_hf_to_gguf) because its RoPE kernel rotates adjacent pairs, while HF's rotates the
    first half against the second. The inverse regroups each head's rows from pairs back to halves.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GgufError(f"cannot split {rows} Q/K rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    regrouped = weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2)
    return regrouped.reshape(weight.shape)


# ---------------------------------------------------------------------- file format
# ``gguf.GGUFReader`` builds a numpy view for every element of every metadata array: with a
# 49k-token vocabulary that alone takes seconds. This header parser reads the same layout with
# plain ``struct`` calls, and hands tensor bytes (memory-mapped) to ``gguf.quants`` for dequantizing.
_MAGIC = b"GGUF"
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
                 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor's entry in the file: ``shape`` in numpy order (rows first), data still packed."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # raw bytes (uint8) or F32/F16 values, memory-mapped


class _HeaderParser:
    def __init__(self, buffer: np.ndarray, path: Path) -> None:
        self.buf = memoryview(buffer)
        self.pos = 0
        self.path = path

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GgufError(f"{self.path} is truncated (header ends early)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise GgufError(f"{self.path} is truncated (string past the end of the file)")
        text = bytes(self.buf[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind == _STRING:
                return [self.string() for _ in range(count)]
            if item_kind in _ARRAY_DTYPES:
                dtype = np.dtype(_ARRAY_DTYPES[item_kind])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += dtype.itemsize * count
                return values.tolist()
            return [self.value(item_kind) for _ in range(count)]  # nested arrays
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind])
        raise GgufError(f"{self.path}: unknown metadata value type {kind}")


@dataclass
class GgufFile:
    """A parsed GGUF file: metadata as plain Python values, tensors as packed memory-mapped data."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo]

    @classmethod
    def open(cls, path: str | Path) -> GgufFile:
        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

        file = Path(path)
        if not file.is_file():
            raise GgufError(f"GGUF file not found: {file}")
        try:
            raw = np.memmap(file, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as exc:
            raise GgufError(f"cannot read {file}: {exc}") from exc
        parser = _HeaderParser(raw, file)
        if len(raw) < 24 or bytes(raw[:4]) != _MAGIC:
            raise GgufError(f"{file} is not a GGUF file (bad magic)")
        parser.pos = 4
        version = parser.scalar("<I")
        if version not in (2, 3):
            raise GgufError(
                f"{file}: unsupported GGUF version {version} (big-endian files are not supported)"
            )
        tensor_count, kv_count = parser.scalar("<Q"), parser.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = parser.string()
            metadata[key] = parser.value(parser.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            name = parser.string()
            dims = [parser.scalar("<Q") for _ in range(parser.scalar("<I"))]
            type_id, offset = parser.scalar("<I"), parser.scalar("<Q")
            infos.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        data_start = -(-parser.pos // alignment) * alignment
        tensors = []
        for name, dims, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GgufError(f"tensor {name!r} has unknown GGML type {type_id}") from None
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            shape = tuple(int(d) for d in reversed(dims))  # ggml lists the fastest dimension first
            if shape[-1] % block_size:
                raise GgufError(f"tensor {name!r}: row of {shape[-1]} is not a whole number of blocks")
            row_bytes = shape[-1] // block_size * type_size
            nbytes = int(np.prod(shape[:-1], dtype=np.int64)) * row_bytes
            start = data_start + offset
            if start + nbytes > len(raw):
                raise GgufError(f"{file} is truncated (tensor {name!r} runs past the end)")
            data = raw[start : start + nbytes]
            if qtype == GGMLQuantizationType.F32:
                data = data.view(np.float32).reshape(shape)
            elif qtype == GGMLQuantizationType.F16:
                data = data.view(np.float16).reshape(shape)
            else:
                data = data.reshape(*shape[:-1], row_bytes)
            tensors.append(GgufTensorInfo(name, qtype.name, shape, data))
        return cls(path=file, metadata=metadata, tensors=tensors)


def hf_config_from_metadata(metadata: dict[str, Any], *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The ``config.json`` an HF checkpoint of this model would have."""
    arch = metadata.get("general.architecture")
    if arch not in _HF_ARCHITECTURE:
        raise GgufError(
            f"unsupported GGUF architecture {arch!r}; jitney loads {', '.join(sorted(_HF_ARCHITECTURE))}"
        )

    def key(name: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise GgufError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    vocab_size = int(metadata.get(f"{arch}.vocab_size") or len(tokens))
    if not vocab_size:
        raise GgufError(f"GGUF metadata gives neither {arch}.vocab_size nor a token list")
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise GgufError(f"unsupported RoPE scaling {scaling!r} in GGUF metadata")
    config: dict[str, Any] = {
        "architectures": [_HF_ARCHITECTURE[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for name in ("bos", "eos", "padding"):
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config["pad_token_id" if name == "padding" else f"{name}_token_id"] = int(value)
    return config


def tokenizer_from_metadata(metadata: dict[str, Any]) -> Tokenizer:
    """Rebuild the tokenizer a GGUF file describes (byte-level BPE, ``tokenizer.ggml.model = gpt2``)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(
            f"unsupported GGUF tokenizer {kind!r}; jitney rebuilds byte-level BPE ('gpt2') vocabularies"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    merges = metadata.get("tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise GgufError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")

    def token_id(name: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{name}_token_id")
        return None if value is None else int(value)

    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in KNOWN_PRE_TOKENIZERS:
        # Refusing the file would be worse than a split that may differ on rare inputs.
        logger.warning("unknown GGUF pre-tokenizer %r: splitting text the GPT-2 way", pre)
        pre = "default"

    try:
        return Tokenizer.from_byte_level_bpe(
            tokens,
            merges,
            token_types=metadata.get("tokenizer.ggml.token_type"),
            pre_tokenizer=pre,
            bos_token_id=token_id("bos"),
            eos_token_id=token_id("eos"),
            unk_token_id=token_id("unknown"),
            pad_token_id=token_id("padding"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )
    except TokenizerError as exc:
        raise GgufError(f"cannot rebuild the GGUF tokenizer: {exc}") from exc


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}


# ---------------------------------------------------------------------- tensors
def dequantize(tensor: GgufTensorInfo) -> np.ndarray:
    """One tensor as a dense float32 array in HF (row-major, out x in) shape."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
        raise GgufError(f"tensor {tensor.name!r} has unsupported type {tensor.type_name}")
    dense = gguf_dequantize(tensor.data, GGMLQuantizationType[tensor.type_name])
    if dense.shape != tensor.shape:
        raise GgufError(f"tensor {tensor.name!r} dequantized to {dense.shape}, expected {tensor.shape}")
    return dense.astype(np.float32, copy=False)


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    # Unquantized tensors come back as read-only views of the memory-mapped file: copy those.
    if not array.flags.writeable or not array.flags.c_contiguous:
        array = np.array(array, dtype=np.float32, order="C")
    return torch.from_numpy(array)


def load_gguf(path: str | Path) -> GgufCheckpoint:
    """Read, dequantize and rename every tensor of a llama-architecture GGUF file (float32)."""
    gguf_file = GgufFile.open(path)
    names = {t.name for t in gguf_file.tensors}
    if "rope_freqs.weight" in names:
        raise GgufError("GGUF files with a rope_freqs tensor (Llama 3.1 RoPE scaling) are not supported")
    config = hf_config_from_metadata(gguf_file.metadata, tie_word_embeddings="output.weight" not in names)
    tokenizer = tokenizer_from_metadata(gguf_file.metadata)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, torch.Tensor] = {}
    for info in gguf_file.tensors:
        name = hf_tensor_name(info.name)
        array = dequantize(info)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            array = unpermute_rotary_rows(array, heads)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            array = unpermute_rotary_rows(array, kv_heads)
        tensors[name] = _to_tensor(array)
    if "model.embed_tokens.weight" not in tensors:
        raise GgufError(f"{path} has no token_embd.weight tensor")
    return GgufCheckpoint(
        config=config, tensors=tensors, tokenizer=tokenizer, generation_config=_generation_config(config)
    )


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no tensor is read)."""
    return tokenizer_from_metadata(GgufFile.open(path).metadata)


def load_gguf_config(path: str | Path) -> dict[str, Any]:
    """Only the HF config of a GGUF file (no tensor is read)."""
    gguf_file = GgufFile.open(path)
    names = {t.name for t in gguf_file.tensors}
    return hf_config_from_metadata(gguf_file.metadata, tie_word_embeddings="output.weight" not in names)

"""Load a checkpoint into a ``DecoderModel``: a Hugging Face directory (config.json plus one or
sharded safetensors files) or a GGUF file / registered name (read by ``jitney.model.gguf``).

Both sources end in the same place, a mapping of Hugging Face tensor names, so one function builds
the model, fuses the projections and checks every shape against the config, naming the tensor
that does not fit.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from jitney.model.config import ModelConfig
from jitney.model.decoder import DecoderModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEVICES = ("cpu", "cuda")


class ModelLoadError(ValueError):
    """A checkpoint that cannot be loaded: missing file, or tensors that contradict the config."""


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    # A directory holding tokenizer.json / tokenizer_config.json, or a tokenizer object rebuilt
    # from a GGUF file's metadata.
    tokenizer: Any
    generation_config: dict[str, Any] = field(default_factory=dict)
    source: str = ""


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX-512 BF16 or AMX)."""
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype | None, device: str = "cpu") -> torch.dtype:
    """The dtype to run in: explicit, or bfloat16 where the hardware has it, else float32."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16
        return torch.bfloat16 if cpu_supports_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)} or auto, got {dtype!r}")
    return DTYPES[dtype]


def resolve_device(device: str) -> str:
    if device.split(":")[0] not in DEVICES:
        raise ModelLoadError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("device cuda requested but torch sees no CUDA device")
    return device


def load_model(
    path_or_name: str | Path | None, dtype: str | torch.dtype | None = None, device: str = "cpu"
) -> LoadedModel:
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = _resolve_path(path_or_name)
    if path.suffix == ".gguf":
        return _load_gguf(path, torch_dtype, device)
    return _load_hf_directory(path, torch_dtype, device)


def _resolve_path(path_or_name: str | Path | None) -> Path:
    """A checkpoint directory, a .gguf file, or a known model name (None: the default model)."""
    from jitney.model.registry import ModelNotFoundError, resolve_model_path

    try:
        return resolve_model_path(path_or_name)
    except ModelNotFoundError as err:
        raise ModelLoadError(str(err)) from None


def _load_gguf(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    from jitney.model.gguf import load_gguf

    ckpt = load_gguf(path)
    model_config = _parse_config(ckpt.config, str(path))
    model = build_model(model_config, _DictSource(ckpt.tensors), dtype, device)
    return LoadedModel(model, model_config, ckpt.tokenizer, dict(ckpt.generation_config or {}), str(path))


def _load_hf_directory(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    if not path.is_dir():
        raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"missing {config_path}: a model directory needs config.json")
    hf_config = json.loads(config_path.read_text())
    model_config = _parse_config(hf_config, str(config_path))
    source = SafetensorsSource.from_directory(path)
    model = build_model(model_config, source, dtype, device)
    gen_path = path / "generation_config.json"
    generation_config = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    return LoadedModel(model, model_config, path, generation_config, str(path))


def _parse_config(hf_config: dict[str, Any], where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(hf_config)
    except ValueError as err:
        raise ModelLoadError(f"{where}: {err}") from None


class TensorSource(Mapping[str, torch.Tensor]):
    """Tensors by Hugging Face name, read one at a time so a checkpoint is never held twice."""


class _DictSource(TensorSource):
    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class SafetensorsSource(TensorSource):
    def __init__(self, files_by_name: dict[str, Path]) -> None:
        self._files_by_name = files_by_name

    @classmethod
    def from_directory(cls, path: Path) -> SafetensorsSource:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = {name: path / shard for name, shard in weight_map.items()}
            for shard in sorted(set(files.values())):
                if not shard.is_file():
                    raise ModelLoadError(f"missing shard {shard} listed in {index}")
            return cls(files)
        shards = sorted(path.glob("*.safetensors"))
        if not shards:
            raise ModelLoadError(f"no *.safetensors file in {path}")
        files = {}
        for shard in shards:
            with safe_open(shard, framework="pt") as f:
                files.update({name: shard for name in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
        return cls(files)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files_by_name[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files_by_name)

    def __len__(self) -> int:
        return len(self._files_by_name)


def build_model(
    cfg: ModelConfig,
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> DecoderModel:
    """Allocate the model and fill it from HF-named tensors, fusing q/k/v and gate/up."""
    model = DecoderModel(cfg, dtype=dtype, device=device)
    get = _checked_getter(tensors)
    h, q, kv, inter, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim

    _copy(model.embed, get("model.embed_tokens.weight", (cfg.vocab_size, h)))
    _copy(model.norm.weight, get("model.norm.weight", (h,)))
    if model.lm_head is not None:
        if "lm_head.weight" in tensors:
            _copy(model.lm_head, get("lm_head.weight", (cfg.vocab_size, h)))
        else:
            log.warning("checkpoint has no lm_head.weight: using the tied input embeddings")
            model.lm_head = None
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.attn, layer.mlp
        _copy(layer.input_norm.weight, get(p + "input_layernorm.weight", (h,)))
        _copy(layer.post_attn_norm.weight, get(p + "post_attention_layernorm.weight", (h,)))
        _copy(
            attn.qkv.weight,
            torch.cat(
                [
                    get(p + "self_attn.q_proj.weight", (q, h)),
                    get(p + "self_attn.k_proj.weight", (kv, h)),
                    get(p + "self_attn.v_proj.weight", (kv, h)),
                ]
            ),
        )
        if attn.qkv.bias is not None:
            _copy(
                attn.qkv.bias,
                torch.cat(
                    [
                        get(p + "self_attn.q_proj.bias", (q,)),
                        get(p + "self_attn.k_proj.bias", (kv,)),
                        get(p + "self_attn.v_proj.bias", (kv,)),
                    ]
                ),
            )
        _copy(attn.o_proj.weight, get(p + "self_attn.o_proj.weight", (h, q)))
        if attn.o_proj.bias is not None:
            _copy(attn.o_proj.bias, get(p + "self_attn.o_proj.bias", (h,)))
        if cfg.qk_norm:
            _copy(attn.q_norm.weight, get(p + "self_attn.q_norm.weight", (hd,)))
            _copy(attn.k_norm.weight, get(p + "self_attn.k_norm.weight", (hd,)))
        _copy(
            mlp.gate_up.weight,
            torch.cat(
                [
                    get(p + "mlp.gate_proj.weight", (inter, h)),
                    get(p + "mlp.up_proj.weight", (inter, h)),
                ]
            ),
        )
        _copy(mlp.down.weight, get(p + "mlp.down_proj.weight", (h, inter)))
        if mlp.gate_up.bias is not None:
            _copy(
                mlp.gate_up.bias,
                torch.cat([get(p + "mlp.gate_proj.bias", (inter,)), get(p + "mlp.up_proj.bias", (inter,))]),
            )
            _copy(mlp.down.bias, get(p + "mlp.down_proj.bias", (h,)))
    return model.eval()


def _checked_getter(tensors: Mapping[str, torch.Tensor]) -> Callable[[str, tuple[int, ...]], torch.Tensor]:
    def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"checkpoint lacks tensor {name} (expected shape {list(shape)})")
        tensor = tensors[name]
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(
                f"tensor {name} has shape {list(tensor.shape)}, but the config expects {list(shape)}"
            )
        return tensor

    return get


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))

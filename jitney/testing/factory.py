"""Tiny random-initialised checkpoints, written the way real ones are.

Each checkpoint is a genuine Hugging Face directory: ``transformers`` writes config.json and
model.safetensors with ``save_pretrained``, and a byte-level BPE tokenizer trained here with
``tokenizers`` is saved next to it with a chat template. Tests therefore exercise the same loading
path as a downloaded model, in seconds. ``transformers`` is a development dependency only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3")

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_BASE_SHAPE: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,
    "eos_token_id": 0,
    "pad_token_id": None,
}

# Text to train the tokenizer on: varied English plus some multi-byte characters, so that
# detokenization of split UTF-8 sequences is exercised too.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Continuous batching schedules every step anew; requests join and leave between iterations.",
    "A paged key-value cache stores attention state in fixed-size blocks addressed by a block table.",
    "Grüße aus Köln! Ça va très bien. Привет, мир. 日本語のテキスト。 Emoji: 🚀🙂",
    "def add(a, b):\n    return a + b\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: ,.;:!?()[]{}",
]


def make_tiny_checkpoint(path: str | Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny ``arch`` checkpoint (llama | qwen2 | qwen3) to ``path`` and return it.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=3``,
    ``tie_word_embeddings=True``, ``rope_scaling={...}``).
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[arch]
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[arch]
    fields = dict(_BASE_SHAPE)
    if arch == "qwen3":
        fields["head_dim"] = 32  # Qwen3 states head_dim explicitly, not hidden / heads
    fields.update(overrides)
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Default init is too small for random models to produce varied greedy outputs; widen it so
    # that parity tests compare distinct, non-degenerate token streams.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path, config.vocab_size)
    return path


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        size = tokenizer.get_vocab_size()
        raise ValueError(f"tokenizer has {size} tokens, more than vocab_size={vocab_size}")
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))

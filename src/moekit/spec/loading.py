"""Where a ModelSpec comes from: a bundled preset, a config.json, a checkpoint folder or a GGUF file.

Presets are real `config.json` files shipped in `moekit/spec/presets/` (file stem = preset name).
Every failure is a SpecError with one line that names the problem.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from moekit.errors import SpecError
from moekit.spec.adapters import ADAPTERS
from moekit.spec.model_spec import ModelSpec

_PRESETS = "presets"


def supported_model_types() -> list[str]:
    return sorted(ADAPTERS)


def spec_from_config(config: dict, name: str) -> ModelSpec:
    if not isinstance(config, dict):
        raise SpecError(f"{name}: a config must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if model_type is None:
        raise SpecError(f"{name}: config has no 'model_type' (supported: {', '.join(supported_model_types())})")
    if model_type not in ADAPTERS:
        raise SpecError(
            f"{name}: unknown model_type {model_type!r} (supported: {', '.join(supported_model_types())})"
        )
    return ADAPTERS[model_type](config, name)


def _preset_files() -> dict[str, resources.abc.Traversable]:
    folder = resources.files("moekit.spec").joinpath(_PRESETS)
    return {p.name[: -len(".json")]: p for p in folder.iterdir() if p.name.endswith(".json")}


def list_presets() -> list[str]:
    return sorted(_preset_files())


def preset_config(name: str) -> dict:
    """A bundled preset's config.json, as a dict."""
    presets = _preset_files()
    if name not in presets:
        raise SpecError(f"{name}: no such preset (presets: {', '.join(sorted(presets))})")
    return _parse(presets[name].read_bytes(), f"preset {name}")


def _parse(text_bytes: bytes, where: str) -> dict:
    if b"\x00" in text_bytes:
        raise SpecError(f"{where}: a binary file, not a config.json")
    try:
        config = json.loads(text_bytes.decode("utf-8"))
    except UnicodeDecodeError:
        raise SpecError(f"{where}: not UTF-8 text (a binary file?), not a config.json") from None
    except json.JSONDecodeError as err:
        raise SpecError(f"{where}: invalid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{where}: a config.json holds a JSON object, this holds {type(config).__name__}")
    return config


def _name_for(path: Path) -> str:
    return path.parent.name if path.name == "config.json" else path.stem


def load_spec(source: str) -> ModelSpec:
    """A preset name, a config.json path or a checkpoint folder holding config.json (a .gguf file:
    moekit.weights.gguf_spec.load_any_spec, which reads its header)."""
    config, name = load_config(source)
    return spec_from_config(config, name)


def load_config(source: str) -> tuple[dict, str]:
    """(config, its name) of a preset name, a config.json path or a folder holding config.json."""
    presets = _preset_files()
    if source in presets:
        return preset_config(source), source
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        raise SpecError(f"{path}: a GGUF file, whose config moekit.weights.gguf_spec.load_any_spec reads")
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise SpecError(f"{path}: folder has no config.json")
        path = config_path
    elif not path.exists():
        raise SpecError(
            f"{source}: no such preset or file (presets: {', '.join(sorted(presets))})"
        )
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SpecError(f"{path}: cannot read ({err.strerror})") from None
    return _parse(data, str(path)), _name_for(path)

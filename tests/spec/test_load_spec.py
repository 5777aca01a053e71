"""load_spec from a preset, a config.json or a checkpoint folder; every bad input is one SpecError
line that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moekit.errors import MoekitError, SpecError
from moekit.spec import list_presets, load_spec, spec_from_config

GOOD = {
    "model_type": "mixtral",
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def write(tmp_path: Path, content: object, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_presets_are_listed_and_load() -> None:
    names = list_presets()
    for expected in ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "gpt-oss-20b", "llama-4-scout-17b-16e"):
        assert expected in names
    for name in names:
        spec = load_spec(name)
        assert spec.name == name and spec.num_layers > 0


def test_a_config_path_and_a_checkpoint_folder_load_the_same_spec(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-mixtral"
    folder.mkdir()
    path = write(folder, GOOD)
    from_file, from_folder = load_spec(str(path)), load_spec(str(folder))
    assert from_file == from_folder
    assert from_file.name == "tiny-mixtral" and from_file.num_layers == 2


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "JSON object"),
        ({**GOOD, "model_type": "bert"}, "unknown model_type 'bert' (supported: "),
        ({k: v for k, v in GOOD.items() if k != "model_type"}, "no 'model_type'"),
        ({k: v for k, v in GOOD.items() if k != "hidden_size"}, "'hidden_size'"),
        ({**GOOD, "hidden_size": "big"}, "'hidden_size' must be an integer"),
        ({**GOOD, "num_hidden_layers": 2.5}, "'num_hidden_layers' must be an integer"),
        ({**GOOD, "hidden_size": 0}, "'hidden_size' must be positive"),
        ({**GOOD, "num_attention_heads": -4}, "'num_attention_heads' must be positive"),
        ({**GOOD, "num_experts_per_tok": 5}, "num_experts_per_tok (5) exceeds the number of routed experts"),
        ({**GOOD, "num_experts_per_tok": 0}, "'num_experts_per_tok' must be positive"),
        ({**GOOD, "rms_norm_eps": "tiny"}, "'rms_norm_eps' must be a number"),
        ({**GOOD, "tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
        ({**GOOD, "rope_theta": -1}, "rope_theta"),
    ],
)
def test_bad_configs_raise_one_clear_line(tmp_path: Path, content: object, needle: str) -> None:
    path = write(tmp_path, content)
    with pytest.raises(SpecError) as err:
        load_spec(str(path))
    message = str(err.value)
    assert needle in message and "\n" not in message


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(SpecError, match="mixtral.*qwen3_moe|qwen3_moe.*mixtral"):
        spec_from_config({**GOOD, "model_type": "t5"}, "t5")


def test_missing_file_names_the_source_and_the_presets(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such preset or file.*mixtral-8x7b"):
        load_spec(str(tmp_path / "nope.json"))
    with pytest.raises(SpecError, match="no such preset or file"):
        load_spec("mixtral-9x9b")


def test_binary_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\x00\xff\xfe")
    with pytest.raises(SpecError, match="binary"):
        load_spec(str(path))


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no config.json"):
        load_spec(str(tmp_path))


def test_spec_errors_are_user_errors() -> None:
    assert issubclass(SpecError, MoekitError)

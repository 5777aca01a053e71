"""GGUFs made the way users get them: tiny Hub checkpoints (transformers' save_pretrained) converted
by llama.cpp's own `convert_hf_to_gguf.py`, the one the llama-cpp-python 0.3.36 sdist vendors.

`./dev test` fetches that sdist once and extracts the converter with its gguf-py into
.venv/llama-cpp-sdist (nothing is built); the converter runs under this venv's python (it needs
torch, transformers and sentencepiece, all test dependencies). One change to its run, none to what
it writes for the weights: the tiny tokenizers are trained here, so their pre-tokenizer hash is none
the converter knows; the run labels it (as moekit.bench.llama_cpp does for the benchmarks).

`rewrite_gguf` copies a GGUF through gguf's own writer with some tensors or keys replaced: the
block-quantized types the converter cannot write (Q4_0, Q4_K, Q6_K) and the bad inputs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest

from hf_tiny import train_tokenizer, write_checkpoint

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.3.36"
VENDOR = REPO / ".venv" / "llama-cpp-sdist" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
TOKENIZER_VOCAB = 300

CONVERT = """
import sys
vendor, label = sys.argv[1], sys.argv[2]
sys.argv = [vendor + "/convert_hf_to_gguf.py", *sys.argv[3:]]
sys.path.insert(0, vendor)
import convert_hf_to_gguf
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: label
convert_hf_to_gguf.main()
"""


def converter() -> Path:
    if not (VENDOR / "convert_hf_to_gguf.py").is_file():
        pytest.fail(f"llama.cpp's converter is not at {VENDOR}: `./dev test` fetches it (the llama-cpp-python "
                    f"{VERSION} sdist, nothing built)")
    return VENDOR


def tiny_checkpoint(family: str, folder: Path, tokenizer: Optional[Callable[[Path], None]] = None, **overrides) -> Path:
    """A tiny random checkpoint with a trained tokenizer the converter accepts (AutoTokenizer must
    not add tokens of its own, hence tokenizer_config.json)."""
    if family == "qwen2_moe":
        overrides.setdefault("mlp_only_layers", [])  # llama.cpp's qwen2moe has no dense layers
    overrides.setdefault("vocab_size", TOKENIZER_VOCAB)  # larger: the converter pads with [PAD{i}] tokens
    write_checkpoint(family, folder, **overrides)
    (tokenizer or (lambda p: train_tokenizer(p, vocab_size=TOKENIZER_VOCAB)))(folder / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "pad_token": "<pad>", "add_bos_token": False, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def convert(folder: Path, outtype: str, out: Path, pre: str = "default") -> Path:
    """llama.cpp's converter on `folder` → `out` (outtype f32, f16, bf16 or q8_0)."""
    argv = [sys.executable, "-c", CONVERT, str(converter()), pre, str(folder), "--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and out.is_file(), done.stderr[-3000:]
    return out


def _add_field(writer, field) -> None:
    import gguf

    types = field.types
    value = field.contents()
    if types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(field.name, value, types[0], sub_type=types[-1])
    else:
        writer.add_key_value(field.name, value, types[0])


def rewrite_gguf(src: Path, dst: Path, tensor: Optional[Callable] = None, metadata: Optional[dict] = None) -> Path:
    """Copy `src` to `dst` with gguf's writer. tensor(name, f32 array in torch order) returns None (keep
    as is) or (raw numpy data, GGMLQuantizationType); metadata replaces string values by key."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, (metadata or {}).get("general.architecture", arch))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if metadata and name in metadata:
            writer.add_string(name, metadata[name])
        else:
            _add_field(writer, field)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        replaced = tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)) if tensor else None
        if replaced is None:
            writer.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        else:
            data, qtype = replaced
            writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst

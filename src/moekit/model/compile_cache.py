"""Where the compiled decode step's artefacts live between processes, and under what key.

Inductor keeps what it compiles on disk (the FX-graph cache: generated code and its C++ libraries;
the AOTAutograd cache in front of it), so a later process that traces the same graph loads the
code instead of generating and compiling it again (~35 s cold against ~3 s warm on the ~140M
qwen3_moe here, measured by benchmarks/compile_startup.py). moekit points those caches at its own
folder, ~/.cache/moekit/compile/<key>/, one per model shape and build, for three reasons: torch's
default is under /tmp (gone at a reboot, shared by every program of the user); one folder per
model is one `rm -r` to clear; and the key isolates what must not be mixed, as the operator build's
does (moekit.ops.build.build_key): torch's version, this CPU's feature flags, a hash of moekit's
model and operator sources, and the decoder's shape, dtype and weight form (every tensor the step
reads: name, dtype, size).

What the key keeps apart is the graphs (the FX-graph and AOTAutograd caches, moekit's saved graphs):
a model must never load another's. The code Inductor generates from them (C++ kernels, their
libraries, the Python that calls them) is named by Inductor itself with a hash of its source and
compiler command, and most of it (norms, rope, softmax, routing) is the same text in many models:
tests/model/test_compiled_step.py's 18 model folders held 436 kernel libraries, 297 distinct. So
that code goes in one folder beside the models', kernels-<the key without the model>, and a kernel
another model built is loaded, not built again. Clearing a model is `rm -r` of its folder; the
kernels folder is only ever read by name, so what it keeps of a removed model is never loaded.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator
from unittest.mock import patch

import torch

from moekit.ops.build import CSRC, cpu_flags, sources_digest
from moekit.ops.torch_private import inductor_cache_dir

DEFAULT_CACHE = Path.home() / ".cache" / "moekit" / "compile"
_PACKAGE = Path(__file__).resolve().parents[1]  # src/moekit
_SOURCES = ("model", "ops")  # the packages whose code the step traces or calls


def python_digest(root: Path = _PACKAGE, packages: tuple[str, ...] = _SOURCES) -> str:
    """A hash of the .py files the compiled step is traced from, in path order."""
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def weights_digest(decoder: torch.nn.Module) -> str:
    """A hash of the decoder's shape, dtype and weight form: every parameter's name, dtype and size,
    each module's class, and the name, dtype and rank of every buffer and every tensor held as a
    plain attribute (int8 stacks, tiles; not their sizes: the rope tables grow with the longest
    cache made). Inductor's own key holds every size of the graph; this one keeps models apart."""
    digest = hashlib.sha256()
    for name, module in decoder.named_modules():
        digest.update(f"{name}:{type(module).__qualname__}\0".encode())
    for name, t in decoder.named_parameters():
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
    for name, t in decoder.named_buffers():
        digest.update(f"{name}:{t.dtype}:{t.dim()}\0".encode())
    for name, module in decoder.named_modules():
        for attr, value in sorted(vars(module).items()):
            for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(t, torch.Tensor):
                    digest.update(f"{name}.{attr}[{i}]:{t.dtype}:{t.dim()}\0".encode())
    return digest.hexdigest()


def tree_key() -> str:
    """What every compile on this machine and tree shares: torch's version, the CPU's capability and
    a hash of its flags, a hash of moekit's sources (Python and C++)."""
    cpu = hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:10]
    code = hashlib.sha256((python_digest() + sources_digest(CSRC)).encode()).hexdigest()[:12]
    torch_version = torch.__version__.replace("+", "_")
    return f"torch{torch_version}-{torch.backends.cpu.get_cpu_capability().lower()}-{cpu}-{code}"


def step_key(decoder: torch.nn.Module, options: dict) -> str:
    """The folder name of one decoder's compiled steps: tree_key and a hash of the decoder and
    Inductor's options."""
    shown = repr(sorted((k, repr(v) if not isinstance(v, dict) else repr(sorted(map(str, v.values()))))
                        for k, v in options.items()))
    model = hashlib.sha256((weights_digest(decoder) + shown).encode()).hexdigest()[:12]
    return f"{tree_key()}-{model}"


def kernels_folder(folder: Path) -> Path:
    """Where the compiles of the model folder `folder` keep Inductor's generated code: one folder
    beside it that every model under the same cache and tree_key shares (the module's docstring)."""
    return folder.parent / f"kernels-{tree_key()}"


def is_cached(folder: Path) -> bool:
    """Whether a compile has written into folder before (the next one then loads, not compiles):
    Inductor's FX-graph cache, or AOTAutograd's with the compiled code bundled into it (the compiled
    step's own compiles: moekit.model.saved_graphs), or saved graphs."""
    return any((folder / sub).is_dir() and any((folder / sub).iterdir()) for sub in ("fxgraph", "aotautograd", "direct"))


@contextmanager
def compiling_into(folder: Path) -> Iterator[None]:
    """Inductor's graph caches read and written in folder while the block runs (a compile or a
    load), and the code they generate in kernels_folder(folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    kernels = kernels_folder(folder)
    kernels.mkdir(exist_ok=True)
    with inductor_cache_dir(str(kernels)), graph_caches_in(folder):
        yield


@contextmanager
def graph_caches_in(folder: Path) -> Iterator[None]:
    """A context in which Inductor's FX-graph cache and AOTAutograd's are folder/fxgraph and
    folder/aotautograd, wherever the rest of Inductor's cache is (inductor_cache_dir). Why private:
    torch puts both under its one cache folder, with no setting of their own; each cache's
    _get_tmp_dir is the one place that names it. Replace with: a public setting of torch.compile
    for the graph caches' folder apart from the generated code's."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCache
    from torch._inductor.codecache import FxGraphCache

    fxgraph, aotautograd = str(folder / "fxgraph"), str(folder / "aotautograd")
    with patch.object(FxGraphCache, "_get_tmp_dir", staticmethod(lambda: fxgraph)), \
            patch.object(AOTAutogradCache, "_get_tmp_dir", classmethod(lambda cls: aotautograd)):
        yield


def start_line(folder: Path | None, batches: tuple[int, ...], prefills: tuple = ()) -> str:
    """What a warm-up is about to do, for the user: compile (first time for this model here), or
    load what an earlier process compiled. Ends in "..." (the time follows it). prefills: the
    prefill graphs' compiled_step.PrefillShape."""
    shapes = "batch " + ", ".join(map(str, batches))
    if prefills:
        shapes += ") and the prefill (" + ", ".join(f"{p.rows} row{'s' * (p.rows > 1)}{' full' * p.full}" for p in prefills)
    if folder is None:
        return f"compiling the decode step ({shapes}; torch's cache) ..."
    if is_cached(folder):
        return f"loading the compiled decode step ({shapes}) from {folder} ..."
    return f"compiling the decode step ({shapes}), once for this model on this machine, into {folder} ..."

"""Building moekit's C++ operators from the files in csrc/, once per machine, CPU and source.

A build is one ISA variant of the same sources (`Variant`): its torch.ops namespace, the suffix its
operator names end in, and the compiler flags that select its vector code. Each is built with
torch.utils.cpp_extension.load into a folder of the cache named after what the build depends on:
torch's version, this CPU's feature flags and a hash of the sources and flags (`build_key`), so a
home directory shared by two CPU models never loads a build made for the other one, and an edit
to any source builds anew without a hand-bumped name. A build that fails keeps the compiler's full
output in that folder (`build.log`) and is reported in one line naming it (`BuildResult.line`).
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("products.cpp", "q8.cpp", "packed.cpp", "attention.cpp", "utilities.cpp", "register.cpp", "shims.cpp")
DEFAULT_CACHE = Path.home() / ".cache" / "moekit" / "ops"
# -fopenmp at compile time only: the parallel regions bind to the OpenMP runtime torch already
# loaded, so there is one thread pool, not two. Hidden visibility: the two builds' same-named C++
# functions each call their own once both libraries are loaded globally (for the C entry points).
COMMON_FLAGS = ("-O3", "-fopenmp", "-fvisibility=hidden")


@dataclass(frozen=True)
class Variant:
    """One build of the sources: namespace (torch.ops.<namespace>), suffix (what its operator names
    end in: "" or "_avx2") and the ISA flags it is compiled with."""

    namespace: str
    suffix: str
    isa_flags: tuple[str, ...]

    def flags(self) -> list[str]:
        defines = [f"-DMOEKIT_NAMESPACE={self.namespace}", f"-DMOEKIT_SUFFIX={self.suffix}"]
        return [*COMMON_FLAGS, *self.isa_flags, *defines]


NATIVE = Variant("moekit", "", ("-march=native",))
# The same sources for AVX2 only, beside the AVX-512 build: on an AMD EPYC (Zen 4) they streamed a
# weight ~20% faster (fp32: 28 against 23 GB/s, 2 threads), on an Intel Xeon the AVX-512 ones were
# faster; moekit.ops.select measures which runs each kind of weight.
NARROW = Variant("moekit_avx2", "_avx2", ("-march=native", "-mno-avx512f"))
# The portable code paths (no AVX at all), built by the tests so that they compile and run on x86.
SCALAR = Variant("moekit_scalar", "_scalar", ("-march=x86-64",))


def machine_variants() -> tuple[Variant, ...]:
    """The builds this machine gets: the native one, and on an AVX-512 CPU the AVX2 one beside it."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return (NATIVE, NARROW)
    return (NATIVE,)


def cpu_flags() -> tuple[str, ...]:
    """This CPU's feature flags as the kernel reports them (sorted), or the machine's name where
    there is no /proc/cpuinfo: what -march=native compiles for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return tuple(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return (platform.machine(), platform.processor())


def sources_digest(csrc: Path = CSRC) -> str:
    """A hash of every file in csrc/ (sources and headers), in name order."""
    digest = hashlib.sha256()
    for path in sorted(csrc.iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def build_key(variant: Variant, csrc: Path = CSRC) -> str:
    """The folder name of one build: torch's version, the CPU's capability and a hash of its flags,
    and a hash of the sources and compiler flags."""
    cpu = hashlib.sha256(" ".join(cpu_flags()).encode()).hexdigest()[:10]
    code = hashlib.sha256((sources_digest(csrc) + " ".join(variant.flags())).encode()).hexdigest()[:12]
    torch_version = torch.__version__.replace("+", "_")
    return f"torch{torch_version}-{torch.backends.cpu.get_cpu_capability().lower()}-{cpu}-{code}"


def build_dir(variant: Variant, cache: Path = DEFAULT_CACHE) -> Path:
    return cache / build_key(variant) / variant.namespace


def library_path(variant: Variant, cache: Path = DEFAULT_CACHE) -> Path:
    return build_dir(variant, cache) / f"{variant.namespace}.so"


def log_path(variant: Variant, cache: Path = DEFAULT_CACHE) -> Path:
    return build_dir(variant, cache) / "build.log"


def is_built(variant: Variant, cache: Path = DEFAULT_CACHE) -> bool:
    """Whether the cache holds this build already (loading it then takes a moment, not a minute)."""
    return library_path(variant, cache).exists()


@dataclass(frozen=True)
class BuildResult:
    """One variant's build: the library's path, or the log of the compiler's output where it failed."""

    variant: Variant
    library: Optional[Path] = None
    log: Optional[Path] = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.library is not None

    def line(self) -> str:
        """One line for the user: what failed and where the whole story is."""
        if self.ok:
            return f"{self.variant.namespace}: built ({self.library})"
        return (f"moekit's C++ operators ({self.variant.namespace}) could not be built: {self.error}; "
                f"the compiler's output is in {self.log}; running the plain PyTorch reference instead")


def build(variant: Variant, cache: Path = DEFAULT_CACHE, extra_flags: tuple[str, ...] = (), csrc: Path = CSRC) -> BuildResult:
    """Build (or find in the cache) one variant and return where its library is. extra_flags are
    appended to the variant's (a test passes one the compiler refuses); csrc: the sources (a
    benchmark builds another version's beside these). A failure writes the compiler's full output
    to build.log in the build's folder and is returned, not raised."""
    from torch.utils.cpp_extension import load

    flags = [*variant.flags(), *extra_flags]
    key = build_key(variant, csrc) + ("-" + _flags_hash(extra_flags) if extra_flags else "")
    folder = cache / key / variant.namespace
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "build.log"
    built = folder / f"{variant.namespace}.so"
    if built.exists():  # the folder's name holds the sources' hash: a library there is this version's
        torch.ops.load_library(str(built))  # no ninja run and no lock file: a killed process cannot leave one
        ctypes.CDLL(str(built), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        return BuildResult(variant, library=built)
    # torch's own lock (a `lock` file it creates and deletes) outlives a build that was killed, and
    # the next build of this key would wait on it for ever. This one is the kernel's: released when
    # its holder dies. Whoever holds it is the only builder, so a `lock` file found then is stale.
    with open(folder / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if built.exists():  # built by another process while this one waited
            return build(variant, cache, extra_flags, csrc)
        (folder / "lock").unlink(missing_ok=True)
        try:
            path = load(name=variant.namespace, sources=[str(csrc / s) for s in SOURCES], extra_cflags=flags,
                        extra_include_paths=[str(csrc)], build_directory=str(folder), is_python_module=False, verbose=False)
        except Exception as err:  # a missing compiler, headers, or a flag it refuses: said, with the log kept
            log.write_text(f"flags: {' '.join(flags)}\n\n{err}\n")
            return BuildResult(variant, log=log, error=_first_error(str(err)) or type(err).__name__)
    if log.exists():
        log.unlink()  # a stale failure's log, from before a fix
    # Loaded globally, so that the compiled step's generated library finds the C entry points.
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    return BuildResult(variant, library=Path(path))


def _flags_hash(flags: tuple[str, ...]) -> str:
    return hashlib.sha256(" ".join(flags).encode()).hexdigest()[:8]


def _first_error(output: str) -> str:
    """The compiler's first `error:` line of a failed build's output (the rest stays in the log)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error:" in ln), lines[0] if lines else "")


__all__ = ["BuildResult", "Variant", "NATIVE", "NARROW", "SCALAR", "build", "build_key", "is_built", "machine_variants"]

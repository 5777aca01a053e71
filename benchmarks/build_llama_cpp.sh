#!/usr/bin/env bash
# Builds the llama.cpp baseline of `moekit bench decode --vs llama.cpp` and the serving benchmark,
# from one sdist, into bench-out/llama.cpp/ (git-ignored; the runtime venv never depends on it):
#
#   bench-out/llama.cpp/venv/                 llama-cpp-python 0.3.36 built from its sdist, numpy,
#                                             and the sdist's own gguf-py (a venv of its own)
#   bench-out/llama.cpp/src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
#   bench-out/llama.cpp/server-build/bin/llama-server, llama-bench   the same vendored llama.cpp, cmake
#
#   benchmarks/build_llama_cpp.sh             # both (5-15 minutes of both cores)
#   benchmarks/build_llama_cpp.sh python      # only the Python binding
#   benchmarks/build_llama_cpp.sh server      # only llama-server
#
# Both builds use -DGGML_NATIVE=ON: the binaries are tuned to (and only run on) this CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
what="${1:-all}"
version=0.3.36
out="$root/bench-out/llama.cpp"
src="$out/src/llama_cpp_python-$version"
vendor="$src/vendor/llama.cpp"
jobs=2
mkdir -p "$out/sdist" "$out/src"

if [ ! -d "$src" ]; then
    "$root/.venv/bin/python" -m pip download "llama-cpp-python==$version" --no-binary :all: --no-deps \
        -d "$out/sdist"
    tar -xzf "$out/sdist/llama_cpp_python-$version.tar.gz" -C "$out/src"
fi

if [ "$what" = all ] || [ "$what" = python ]; then
    if [ ! -x "$out/venv/bin/python" ]; then
        python3 -m venv "$out/venv" 2>/dev/null || "$root/.venv/bin/python" -m venv "$out/venv"
    fi
    "$out/venv/bin/python" -m pip install -q --upgrade pip
    "$out/venv/bin/python" -m pip install -q numpy "$vendor/gguf-py"
    if ! "$out/venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
        CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
            "$out/venv/bin/python" -m pip install -v "$src" > "$out/build-python.log" 2>&1 \
            || { tail -40 "$out/build-python.log"; exit 1; }
    fi
    "$out/venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, llama_cpp.__file__)"
fi

if [ "$what" = all ] || [ "$what" = server ]; then
    cmake -S "$vendor" -B "$out/server-build" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON \
        -DCMAKE_BUILD_TYPE=Release > "$out/build-server.log" 2>&1 || { tail -40 "$out/build-server.log"; exit 1; }
    cmake --build "$out/server-build" --target llama-server llama-bench -j"$jobs" >> "$out/build-server.log" 2>&1 \
        || { tail -40 "$out/build-server.log"; exit 1; }
    echo "llama-server, llama-bench: $out/server-build/bin/"
fi

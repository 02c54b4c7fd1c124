#!/usr/bin/env bash
# CUDA checks and GPU timings, for a lent GPU machine with no network (its own python3 and torch).
#   bash bench/gpu_check.sh CONFIG_DIR OUT_DIR
# CONFIG_DIR: the default model's config.json + tokenizer files (`ingot convert` output minus the
# weights); the timings run on random weights of that shape (bench/random_weights.py). Each step
# has its own time limit so that one stuck step still leaves the others' results in OUT_DIR.
cfg=$1
out=$2
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 INGOT_CACHE_ROOT=/tmp/ingot-cache
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/env.txt"
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__,
torch.version.cuda, transformers.__version__, torch.cuda.get_device_name())" | tee -a "$out/env.txt"
python3 bench/random_weights.py "$cfg" /tmp/rw 2>&1 | tail -1
# max_model_len 512 and 64 sequences: 20 compiled graphs, 14 of them decode buckets.
flags="--no-progress --model /tmp/rw --device cuda --max-model-len 512 --max-num-seqs 64"
bench() {  # LIMIT LABEL ARGS...
    local limit=$1 label=$2
    shift 2
    echo "== $label" | tee -a "$out/bench.log"
    timeout "$limit" python3 -m ingot.cli.main bench $flags "$@" 2>&1 | tee -a "$out/bench.log"
}
[ -n "$SKIP_EAGER" ] || bench 60 "eager (--enforce-eager)" offline,single --enforce-eager
bench 60 "CUDA graphs, eager layers (--no-compile)" offline,single,sweep --no-compile
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_cuda.py \
    tests/unit/test_cuda_graphs.py 2>&1 | tee "$out/tests.log"
bench 110 "CUDA graphs + compiled layers (cold cache)" offline,single --compile
bench 45 "CUDA graphs + compiled layers (warm cache)" single --compile

#!/usr/bin/env bash
# Every GPU test (the 2-GPU ones included) and the 2-GPU transport bench, in ONE
# call of the device tool on nvidia-h200-x2.
#
# Once, in this checkout (.devbundle is git-ignored, so `carry` takes it along;
# ../shared/device/README.md says what the bundle holds):
#   echo /.devbundle/ >> .git/info/exclude
#   mkdir -p .devbundle && cp ../shared/device/site.tar.xz \
#       ../shared/device/wheels/torch_memory_saver-*.whl .devbundle/
# Then the one call:
#   run(kind="nvidia-h200-x2", carry=[".devbundle"], timeout_s=600,
#       command="bash scripts/gpu2.sh")
#
# What comes back under $OUT:
#   gpu.txt              nvidia-smi, and the topology between the GPUs (NVLink or PCIe)
#   bench_2gpu.txt/json  distributed (NCCL) beside a peer copy, 1 GB and 3 GB bf16
#   pytest_2gpu.txt      tests/gpu2 and tests/megatron/test_gpu_tp2.py (-s: measured diffs)
#   pytest_megatron.txt  the 1-GPU megatron tests, on GPU 1
#   pytest_1gpu.txt      every other GPU test, on GPU 0
#   summary.txt          each phase's exit status, pass/fail lines and pytest's last line
#
# Timeline within the call's 600 s (each phase ends by its deadline, through
# `timeout`, so every phase's output comes back even when one overruns):
#   ~20 s     unpack the bundle
#   -> 200 s  the bench, alone on the machine (its figures need quiet GPUs)
#   -> 460 s  the 2-GPU tests; beside them, from the same moment to 585 s, the
#             1-GPU megatron tests in a Ray cluster of their own on GPU 1 (on the
#             one-GPU machine the whole GPU suite did not end within 345 s; its
#             megatron RL run was the test left unfinished)
#   -> 585 s  once the 2-GPU tests end, the other 1-GPU tests on GPU 0 (one of
#             them measures the memory its GPU frees, so it runs alone there)
# Arguments pick phases: bench, tests (the 2-GPU tests), megatron, rest (the
# other 1-GPU tests); no argument runs all. A second call can finish what a
# first one ran out of time for, e.g. `bash scripts/gpu2.sh megatron rest`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu2-out}
PY=${PY:-python3}
END=${GPU2_END_S:-585} # seconds after this script starts by which everything has ended
PHASES=${*:-bench tests megatron rest}
mkdir -p "$OUT"

tar -xJf .devbundle/site.tar.xz -C /tmp || { echo "no .devbundle/site.tar.xz: see the header" >&2; exit 2; }
export PYTHONPATH=/tmp/devsite:$PWD RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .devbundle/torch_memory_saver-*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/devsite .devbundle/torch_memory_saver-*.whl 2>&1 | tail -2
fi
{ nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv; nvidia-smi topo -m; } >"$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

has() { [[ " $PHASES " == *" $1 "* ]]; }
left() { # seconds from now to a deadline, at least 1 (`timeout 0` would mean none)
    local s=$(($1 - SECONDS))
    echo $((s < 1 ? 1 : s))
}
# pytest-timeout ends a hung test (an NCCL wait, a placement group that never fits)
# and goes on with the next; the device image has it, a plain pytest does not.
PER_TEST=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout=200)
gpu_pytest() { # deadline, log name, CUDA_VISIBLE_DEVICES (all: every GPU), pytest arguments...
    local deadline=$1 log=$2 devices=$3
    shift 3
    local pin=()
    [ "$devices" = all ] || pin=(env "CUDA_VISIBLE_DEVICES=$devices")
    timeout -k 10 "$(left "$deadline")" ${pin[@]+"${pin[@]}"} "$PY" -m pytest -m gpu -p no:cacheprovider \
        -s -rA --durations=0 ${PER_TEST[@]+"${PER_TEST[@]}"} "$@" >"$OUT/$log" 2>&1
    echo "$log rc=$?" >>"$OUT/summary.txt"
}
: >"$OUT/summary.txt"

if has bench; then
    timeout -k 10 "$(left 200)" "$PY" -m bench.transport_2gpu --sizes 1000 3000 \
        --dtype bfloat16 --bucket-mb 512 2048 --repeats 5 --out "$OUT/bench_2gpu.json" \
        >"$OUT/bench_2gpu.txt" 2>&1
    echo "bench_2gpu rc=$?" >>"$OUT/summary.txt"
fi
if has megatron; then
    gpu_pytest "$END" pytest_megatron.txt 1 tests/megatron --ignore=tests/megatron/test_gpu_tp2.py &
    MEGATRON=$!
fi
if has tests; then
    gpu_pytest 460 pytest_2gpu.txt all tests/gpu2 tests/megatron/test_gpu_tp2.py
fi
if has rest; then
    gpu_pytest "$END" pytest_1gpu.txt 0 tests --ignore=tests/gpu2 --ignore=tests/megatron
fi
[ -n "${MEGATRON:-}" ] && wait "$MEGATRON"

for f in "$OUT"/pytest_*.txt; do
    [ -f "$f" ] || continue
    {
        echo "== $(basename "$f")"
        grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " "$f"
        grep -E "^=+ .*(passed|failed|error|skipped|no tests ran).* =+$" "$f" | tail -1
    } >>"$OUT/summary.txt"
done
{
    echo "== bench_2gpu"
    grep "^|" "$OUT/bench_2gpu.txt" 2>/dev/null | awk '!seen[$0]++' # rows printed twice
    grep -q "^|" "$OUT/bench_2gpu.txt" 2>/dev/null || tail -3 "$OUT/bench_2gpu.txt" 2>/dev/null
} >>"$OUT/summary.txt"
echo "ended at ${SECONDS}s"
cat "$OUT/summary.txt"

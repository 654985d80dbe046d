#!/usr/bin/env bash
# Peer benchmark: tandem's cpu engine against llama.cpp on the same weights,
# side by side in ONE run (not part of CI). Everything of llama.cpp's lives
# outside the repository, under $PEERS:
#   1. llama.cpp's source from the llama-cpp-python sdist on PyPI
#      (vendor/llama.cpp, with its converter convert_hf_to_gguf.py), built
#      with its defaults (GGML_NATIVE, OpenMP): llama-bench, llama-batched-bench;
#   2. a venv with the converter's Python requirements (torch, transformers);
#   3. the models: the bundled models/tandem-kjv and a generated ~189M-param
#      Llama (tools/make_random_model.py, bf16 safetensors: both engines load
#      it as f32), each converted to an f32 GGUF (bench/peers/convert_to_gguf.py);
#   4. the run, per model in ROUNDS rounds, each round every thread count,
#      interleaved so both engines see the same machine: memory bandwidth
#      (memcpy and a parallel read, in `tandem bench engine`), then tandem,
#      then llama-bench (pp512, tg128) and llama-batched-bench (16-token
#      prompts, 128 generated, batch 1 and 8); `uptime` before and after each
#      engine. This host's memory bandwidth moves by a third from minute to
#      minute (bench/results/cpu_vs_llamacpp/session-41.md to -43.md), so one
#      engine's part a minute after the other's can land in another phase:
#      rounds of REPS repetitions each, alternated, give every comparison
#      (tandem / llama.cpp, 2 threads / 1 thread) pairs measured minutes
#      apart at most, and the report gives each round's ratio beside the
#      ratio of the means;
#   5. bench/peers/report.py turns the results into the markdown tables of
#      bench/results/cpu_vs_llamacpp/ (one file per run or session).
#
#   bench/peers/run.sh                      # everything (first run: ~30 min)
#   PEERS=/tmp/peers THREADS="1 2" ROUNDS=3 REPS=2 bench/peers/run.sh
#   SKIP_SETUP=1 bench/peers/run.sh         # steps 4-5 only (1-3 done before)
#
# Needs: a tandem build (TANDEM, default build/tandem), cmake, a C++ compiler,
# python3 with venv, network access to PyPI for the first run.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PEERS=${PEERS:-/tmp/peers}
TANDEM=${TANDEM:-$REPO/build/tandem}
THREADS=${THREADS:-"1 2"}
REPS=${REPS:-2}
ROUNDS=${ROUNDS:-3}
LCP_VERSION=${LCP_VERSION:-0.3.36}   # llama-cpp-python sdist
OUT=${OUT:-$PEERS/results/$(date -u +%Y%m%dT%H%M%SZ)}
case "$PEERS" in "$REPO"|"$REPO"/*) echo "PEERS must be outside the repository" >&2; exit 2 ;; esac
[[ -x "$TANDEM" ]] || { echo "no tandem binary at $TANDEM (build it first)" >&2; exit 2; }

SRC=$PEERS/llama_cpp_python-$LCP_VERSION/vendor/llama.cpp
LBUILD=$PEERS/llama-build
MODELS=$PEERS/models

setup() {
  mkdir -p "$PEERS" "$MODELS"
  if [[ ! -d $SRC ]]; then
    python3 -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LCP_VERSION" -d "$PEERS"
    tar -C "$PEERS" -xzf "$PEERS/llama_cpp_python-$LCP_VERSION.tar.gz"
  fi
  if [[ ! -x $LBUILD/bin/llama-bench || ! -x $LBUILD/bin/llama-batched-bench ]]; then
    cmake -S "$SRC" -B "$LBUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build "$LBUILD" -j"$(nproc)" --target llama-bench llama-batched-bench
  fi
  if [[ ! -x $PEERS/venv/bin/python ]] || ! "$PEERS/venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
    python3 -m venv "$PEERS/venv"
    # The converter's pins (requirements/requirements-convert_hf_to_gguf.txt).
    "$PEERS/venv/bin/pip" install -q torch==2.11.0 'numpy~=2.2.6' 'sentencepiece>=0.1.98,<0.3.0' \
      transformers==4.57.6 'protobuf>=4.21.0,<5.0.0' safetensors
  fi
  if [[ ! -f $MODELS/llama189m/config.json ]]; then
    # 189.0M parameters, 756 MB as f32: hidden 1024, 12 layers, 16/4 heads,
    # intermediate 2496, vocab 32000, untied lm_head.
    python3 "$REPO/tools/make_random_model.py" "$MODELS/llama189m" --layers 12 --hidden 1024 \
      --intermediate 2496 --heads 16 --kv-heads 4 --head-dim 64 --vocab 32000 --layers-per-shard 12
  fi
  for m in kjv llama189m; do
    local dir=$REPO/models/tandem-kjv
    [[ $m == llama189m ]] && dir=$MODELS/llama189m
    if [[ ! -f $MODELS/$m-f32.gguf ]]; then
      "$PEERS/venv/bin/python" "$REPO/bench/peers/convert_to_gguf.py" "$SRC" "$dir" \
        "$REPO/models/tandem-kjv" "$MODELS/$m-f32.gguf"
    fi
  done
}

load() { echo "$(date -u +%H:%M:%S) $(cut -d' ' -f1-3 /proc/loadavg)"; }

# CPU seconds all CPUs spent busy / idle so far (/proc/stat, USER_HZ ticks).
cpu_ticks() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9, $5+$6}' /proc/stat; }

# measured NAME CMD...: runs CMD, and appends to $OUT/others.txt the share
# of the machine's CPU time that OTHER processes used meanwhile ((busy ticks
# - this command's user+sys) / all ticks): the load next to each number.
measured() {
  local name=$1; shift
  local hz b0 i0 b1 i1 tf
  hz=$(getconf CLK_TCK)
  read -r b0 i0 < <(cpu_ticks)
  tf=$(mktemp)
  { TIMEFORMAT='%R %U %S'; time "$@" 2>&3; } 3>&2 2> "$tf"
  read -r b1 i1 < <(cpu_ticks)
  read -r real user sys < "$tf"
  rm -f "$tf"
  awk -v n="$name" -v db=$((b1 - b0)) -v di=$((i1 - i0)) -v hz="$hz" -v r="$real" -v u="$user" \
    -v s="$sys" 'BEGIN { o = (db / hz - u - s) / ((db + di) / hz); if (o < 0) o = 0;
      printf "%s wall %.1f s, own cpu %.1f s, others %.0f%% of the machine\n", n, r, u + s, 100 * o }' \
    >> "$OUT/others.txt"
}

# run_tandem MODEL THREADS ROUND DIR / run_llama MODEL THREADS ROUND: one
# engine's part of a round; results in $OUT/<engine>-MODEL-tTHREADS-rROUND.*
run_tandem() {
  local m=$1 t=$2 r=$3 dir=$4
  echo "$m $t tandem start $(load) $r" >> "$OUT/load.txt"
  measured "$m $t r$r tandem" "$TANDEM" bench engine --model "$dir" --threads "$t" --batch 1,8 \
    --prompt-tokens 512 --decode-tokens 128 --decode-prompt 16 --reps "$REPS" --json "$OUT/tandem-$m-t$t-r$r.json"
  echo "$m $t tandem end $(load) $r" >> "$OUT/load.txt"
}

run_llama() {
  local m=$1 t=$2 r=$3
  echo "$m $t llama.cpp start $(load) $r" >> "$OUT/load.txt"
  measured "$m $t r$r llama-bench" "$LBUILD/bin/llama-bench" -m "$MODELS/$m-f32.gguf" -t "$t" -p 512 \
    -n 128 -r "$REPS" -o json > "$OUT/llamabench-$m-t$t-r$r.json"
  measured "$m $t r$r llama-batched-bench" "$LBUILD/bin/llama-batched-bench" -m "$MODELS/$m-f32.gguf" \
    -t "$t" -tb "$t" -c 4096 -b 2048 -ub 512 -npp 16 -ntg 128 -npl 1,8 --output-format jsonl \
    > "$OUT/batched-$m-t$t-r$r.jsonl" 2> "$OUT/batched-$m-t$t-r$r.log"
  echo "$m $t llama.cpp end $(load) $r" >> "$OUT/load.txt"
}

run() {
  mkdir -p "$OUT"
  {
    echo "tandem: $("$TANDEM" version 2>/dev/null | head -1) ($(git -C "$REPO" rev-parse --short HEAD))"
    echo "llama.cpp: llama-cpp-python $LCP_VERSION sdist, vendor/llama.cpp"
    echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cpus"
    echo "threads: $THREADS; rounds: $ROUNDS; reps per round: $REPS"
  } > "$OUT/meta.txt"
  for m in kjv llama189m; do
    local dir=$REPO/models/tandem-kjv
    [[ $m == llama189m ]] && dir=$MODELS/llama189m
    for r in $(seq 1 "$ROUNDS"); do
      for t in $THREADS; do
        echo "== $m, $t thread(s), round $r of $ROUNDS"
        # Odd rounds tandem first, even rounds llama.cpp first: a drift
        # within a round favours neither engine.
        if ((r % 2)); then
          run_tandem "$m" "$t" "$r" "$dir"
          run_llama "$m" "$t" "$r"
        else
          run_llama "$m" "$t" "$r"
          run_tandem "$m" "$t" "$r" "$dir"
        fi
      done
    done
  done
  python3 "$REPO/bench/peers/report.py" "$OUT" | tee "$OUT/report.md"
}

[[ -n ${SKIP_SETUP:-} ]] || setup
run
echo "results in $OUT"

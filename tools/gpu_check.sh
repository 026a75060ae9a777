#!/bin/bash
# The prepared GPU check, the FIRST call of a GPU session (timeouts sized for at most 7 minutes on one H100/H200;
# every step under its own timeout, logs in $OUT). Steps:
#   1. the CUDA values of the device-parametrized tests (tests/loop: every route kept equals sequential on the
#      device, streams + graphs keep dropout masks, BatchNorm + vmap + bf16; their CPU values run in CI);
#   2. tools/gpu_paths.py: a LightningModule under FedAvg and FedSAM (sequential and compiled stacked), Swin-T at
#      224 px with RandAugment on the device (one round, s/step), `vmap_chunk: auto` on ResNet-18 (chunk chosen, no
#      OOM), a forced compile failure (the fallback line);
#   3. RoBERTa-base-sized random LoRA (`tools/bench.py --lora --lora-size base`: s/round, tokens/s, bytes, peak GPU
#      memory);
#   4. an 8-round `fedlight fit` of the headline recipe (FedNSAM, ResNet-18) on a CIFAR-10 subset, eval every round
#      (it must exit right after its summary: the seconds from summary to exit are printed);
#   5. only with BENCH=1: `tools/bench.py --gpu` (every seed rule and runner; measured in results/performance.md §6).
# The route comparison is the SECOND call: `bash tools/gpu_check.sh --routes` (same setup, then
# `tools/gpu_profile.py --sections anchor,routes,wgrad --rounds 2` under ROUTES_S, default 420 s: anchor (a) and (b),
# the routes of fedlight.lab.benchmarks.routes.FIRST_CALL one line each as measured, then the route table (ratio to (a),
# MFU) and a profile of the fastest route's round; last, the grouped weight gradient in Triton against cuDNN).
# Layout: an ignored folder .gpu/ in the checkout holding whl/ (jsonargparse, docstring-parser, typeshed-client
# wheels for the GPU machine's Python) and data/cifar10-jpeg (../shared/tools/make_cifar10_subset.sh .gpu/data 1000).
# Run from the project root: `bash tools/gpu_check.sh` (carry .gpu). VARIANTS, *_S timeouts, ROUNDS override.
# `--smoke` (alone or after --routes): the same steps on the CPU at tiny sizes (no .gpu/, no wheels; the tests, fit
# and bench skipped, CI runs the tests' CPU values; numbers meaningless) — tests/test_gpu_tools.py runs both.
set -u
SMOKE=0; ROUTES=0
for a in "$@"; do case $a in --smoke) SMOKE=1;; --routes) ROUTES=1;; *) echo "unknown option $a"; exit 2;; esac; done
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
FAILED=0; step() { local rc=$1; echo "rc=$rc"; [ "$rc" = 0 ] || FAILED=$((FAILED + 1)); }
routes() {  # $1: extra options of tools/gpu_profile.py
  el "routes"
  timeout ${ROUTES_S:-420} python3 tools/gpu_profile.py --sections anchor,routes,wgrad --rounds 2 $1 > "$OUT/routes_log.txt" 2>&1
  step $?; grep "^anchor:\|^routes:\|^profile:\|^wgrad:\|^|\|^\[" "$OUT/routes_log.txt" | cut -c1-400
  el "done: $FAILED step(s) failed"; [ $FAILED = 0 ]; exit
}
if [ $SMOKE = 1 ]; then
  SM=--smoke; LORA="--tiny"; export PYTHONUNBUFFERED=1
  [ $ROUTES = 1 ] && routes --smoke
else
  SM=; LORA="--lora-size base --clients 4 --reps 2 --warmup 1"
  D=${GPU_ASSETS:-$PWD/.gpu}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$D"/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FEDLIGHT_DATA=$D/data FEDLIGHT_CACHE=/tmp/flcache
  { nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version --format=csv
    python3 -c "import torch, lightning, jsonargparse, fedlight; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"; git rev-parse --short HEAD 2>/dev/null >> "$OUT/env.txt"
  [ $ROUTES = 1 ] && routes ""
  el "cuda tests"
  timeout ${TEST_S:-150} python3 -m pytest -q -x tests/loop/test_runners.py tests/loop/test_runner_routes.py \
    -k cuda -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1; step $?; tail -3 "$OUT/cuda_tests.txt"
fi
el "paths"
timeout ${PATHS_S:-120} python3 tools/gpu_paths.py $SM > "$OUT/paths_log.txt" 2>&1; step $?
grep "^paths:\|^\[" "$OUT/paths_log.txt" | cut -c1-400
el "lora"
timeout ${LORA_S:-100} python3 tools/bench.py --lora $LORA --json "$OUT/lora.json" --out "$OUT/lora.txt" \
  > "$OUT/lora_log.txt" 2>&1; step $?
grep -A1 "^roberta-lora" "$OUT/lora_log.txt" | cut -c1-600
if [ $SMOKE = 0 ]; then
  el "fit"; rm -f /tmp/e2e_summary_at
  timeout ${FIT_S:-60} python3 -m fedlight fit --config recipes/fednsam_resnet18.yaml --data fedlight.data.CIFAR10 \
    --data.init_args.num_clients 20 --model.init_args.num_classes 10 --loop.rounds ${ROUNDS:-8} --out_dir /tmp/e2e \
    2>&1 | while IFS= read -r l; do echo "$l"; [[ $l == "wall time (s)"* ]] && date +%s.%N > /tmp/e2e_summary_at; done \
    > "$OUT/e2e_log.txt"; step ${PIPESTATUS[0]}; END=$(date +%s.%N)
  tail -6 "$OUT/e2e_log.txt"; cp /tmp/e2e/metrics.jsonl "$OUT/e2e_metrics.jsonl" 2>/dev/null
  [ -f /tmp/e2e_summary_at ] && echo "fit: exit $(python3 -c "print(f'{$END - $(cat /tmp/e2e_summary_at):.2f}')") s after its summary (goal < 0.5 s)"
  OUT=$OUT python3 - <<'PY'
import json, os, statistics
p = os.path.join(os.environ["OUT"], "e2e_metrics.jsonl")
if os.path.exists(p):
    rows = [json.loads(l) for l in open(p)]
    t = [r.get("round_time_s", 0) + r.get("eval_time_s", 0) + r.get("checkpoint_time_s", 0) for r in rows]
    print("e2e rounds", len(rows), "median s/round incl eval+ckpt (rounds 3+):", statistics.median(t[2:]) if len(t) > 2 else t,
          "first", t[:2], "last acc", rows[-1].get("test_acc"))
PY
  if [ "${BENCH:-0}" = 1 ]; then
    el "bench"
    timeout ${BENCH_S:-150} python3 tools/bench.py --gpu --reps 2 --warmup 0 --gpu-variants "${VARIANTS:-fedavg,fedavg+sequential,fedavg+vmap,fedavg+channels_last,fedavg+reduce-overhead}" \
      --json "$OUT/bench.json" --out "$OUT/bench.txt" > "$OUT/bench_log.txt" 2>&1; step $?
    grep "^gpu-row" "$OUT/bench_log.txt" | cut -c1-420
  fi
fi
el "done: $FAILED step(s) failed"
[ $FAILED = 0 ]

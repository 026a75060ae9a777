#!/bin/bash
# The prepared GPU check (timeouts sized for at most 6 minutes on one H100; one command, every step under its own timeout, logs in $OUT):
# the CUDA-only runner tests, `tools/bench.py --gpu` (every seed rule and runner), and a 30-round `fedlight fit` of
# the headline recipe (FedNSAM, ResNet-18) on a CIFAR-10 subset with evaluation every round.
# Layout: an ignored folder .gpu/ in the checkout holding whl/ (jsonargparse, docstring-parser, typeshed-client
# wheels for the GPU machine's Python) and data/cifar10-jpeg (../shared/tools/make_cifar10_subset.sh .gpu/data 1000).
# Run from the project root: `bash tools/gpu_check.sh` (carry .gpu). VARIANTS, BENCH_S, FIT_S, ROUNDS override.
set -u
D=${GPU_ASSETS:-$PWD/.gpu}
OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$D"/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FEDLIGHT_DATA=$D/data FEDLIGHT_CACHE=/tmp/flcache
{ nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,memory.total,driver_version --format=csv
  python3 -c "import torch, lightning, jsonargparse, fedlight; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
el "cuda tests"
timeout ${TEST_S:-80} python3 -m pytest -q -x tests/loop/test_runners.py -k "cuda or compiled_stacked" -p no:cacheprovider > "$OUT/cuda_tests.txt" 2>&1; echo "rc=$?"; tail -3 "$OUT/cuda_tests.txt"
el "bench"
timeout ${BENCH_S:-180} python3 tools/bench.py --gpu --reps 2 --warmup 0 --gpu-variants "${VARIANTS:-fedavg,fedavg+sequential,fedavg+vmap,fednsam,fedavg+reduce-overhead,fedwmsam,fedswa,fedadamw,fedcm,fedsam,fedgamma,fedavg+bn,fedavg+bn+vmap}" \
  --json "$OUT/bench.json" --out "$OUT/bench.txt" > "$OUT/bench_log.txt" 2>&1; echo "rc=$?"
grep "^gpu-row" "$OUT/bench_log.txt" | cut -c1-420
grep -i "error\|Traceback" "$OUT/bench_log.txt" | head -5
el "fit"
timeout ${FIT_S:-110} python3 -m fedlight fit --config recipes/fednsam_resnet18.yaml --data fedlight.data.CIFAR10 \
  --data.init_args.num_clients 20 --model.init_args.num_classes 10 --loop.rounds ${ROUNDS:-30} --out_dir /tmp/e2e \
  > "$OUT/e2e_log.txt" 2>&1; echo "rc=$?"
tail -12 "$OUT/e2e_log.txt"; cp /tmp/e2e/metrics.jsonl "$OUT/e2e_metrics.jsonl" 2>/dev/null
python3 - <<'PY'
import json, os, statistics
p = os.path.join(os.environ.get("OUT", "gpu_out"), "e2e_metrics.jsonl")
if os.path.exists(p):
    rows = [json.loads(l) for l in open(p)]
    t = [r.get("round_time_s", 0) + r.get("eval_time_s", 0) + r.get("checkpoint_time_s", 0) for r in rows]
    print("e2e rounds", len(rows), "median s/round incl eval+ckpt (rounds 3+):", statistics.median(t[2:]) if len(t) > 2 else t,
          "first", t[:2], "last acc", rows[-1].get("test_acc"))
PY
el "done"

#!/bin/bash
# One GPU window for a table column: FedNSAM (MM'25) Table 2, LeNet-5 on CIFAR-10 (issue 38): 11 rows x 3 seeds x
# 1000 rounds through `fedlight reproduce --per-gpu auto` (many runs share the card; seed 0 of every row first, then
# seeds 1 and 2). It stops cleanly before its limit (the runs stop after their round, checkpointed), so the next
# call on the same machine resumes them; finished runs committed under results/ are restored on a fresh machine, and
# so are the unfinished runs a window brought back (resume.tar.gz, below) and the next one carries in .gpu/resume/.
# It leaves under $OUT: table.tar.gz (results/fednsam_table2_lenet5_cifar10/: table.md, table.csv, curves, and
# runs/<row>/lenet5_cifar10/seed<k>/ with metrics.jsonl, summary.json, config.yaml, reproduce.json), log.txt,
# env.txt, table_log.txt, and resume.tar.gz (or resume.tar.gz.part01.. of 15 MiB): the unfinished runs, each with its
# latest checkpoint, furthest along first, as many as one call brings back (tools/resume_runs.py). Untar
# table.tar.gz in the project root and commit; put the resume files in .gpu/resume/ for the next window.
#
#   bash tools/gpu_table.sh --prepare   HERE, once: .gpu/whl (jsonargparse & co. for the GPU machine's Python 3.12)
#                                       and .gpu/parts (the decoded CIFAR-10 in three parts of <= 40 MiB, with SHA-256s)
#   bash tools/gpu_table.sh [--limit S] THERE (the `run` tool, carry .gpu/whl + the manifest + one part per call,
#                                       and the resume files of the last window, if any): reassembles and checks the
#                                       data once every part has come, restores the runs of .gpu/resume, then runs
#                                       the table for at most S seconds in all (default 540); a call that brings a
#                                       part but not yet the last says which are missing and exits 0
#   bash tools/gpu_table.sh --smoke     the whole path on the CPU at a tiny size (tests/test_gpu_table.py)
#   ... --bench                         first, the device benchmark (tools/gpu_lockstep_bench.py, <= 120 s, synthetic
#                                       data) and the CUDA values of the exactness tests (pytest -k cuda), in
#                                       $OUT/bench.txt, bench.json and cuda_tests.txt; then the call goes on as usual
#   ... --bench-only                    the same, then stops (no data, no table). BENCH_ARGS: the benchmark's own
#                                       flags (e.g. "--sections step,unions --routes compiled,compiled+mm");
#                                       CUDA_TESTS=0 skips the tests
# The runs: the column's stateful rows (STATEFUL_ROWS, default scaffold fedgamma fedsmoo: their client states, ~0.3-0.6
# GB a run, cannot come back) start first and only when the plan says they finish in this call: ROUNDS x
# STATEFUL_S_PER_ROUND (seconds a round of their lockstep group, measured in an earlier window; unset: not started,
# one line says so) within the time left. The stateless rows take the rest; what they do not finish comes back as
# checkpoints (resume.tar.gz). With a `fedlight reproduce` that has `--lockstep` (LOCKSTEP=auto, the default on the
# GPU; 1 forces it, 0 leaves it off, column puts a column's runs in one process), the runs of a phase train in
# lockstep groups (FEDLIGHT_LOCKSTEP_STREAMS=on|off|auto reaches their `fedlight lockstep --streams`). MPS=1 runs
# them under an MPS daemon of this call (quit after them; one line if there is none).
# docs/contributing/gpu_table.md gives the exact `run` calls. Variables: PER_GPU (auto), SEEDS (3), CELLS, RESTORE_FROM,
# RESUME_FROM (.gpu/resume), RESUME_PARTS (4), PYTHON, FIT_ARGS (how the runs execute; default "--loop.save_every 25":
# a checkpoint every 25 rounds, and one whenever a run is stopped, instead of one per round from 16 processes at
# once). Next window, try FIT_ARGS="--loop.save_every 25 --loop.client_parallelism vmap" (one LeNet-5 run alone:
# 0.567 s/round stacked vs 1.823 sequential on an H200) and compare the table's rounds/s (last line of the
# reproduce step) with the 5.43 of 2026-11-28's 16 runs on the default route.
set -u
MODE=gpu; LIMIT=540; BENCH=0
while [ $# -gt 0 ]; do
  case $1 in
    --smoke) MODE=smoke ;; --prepare) MODE=prepare ;; --bench) BENCH=1 ;; --bench-only) BENCH=2 ;;
    --limit) LIMIT=$2; shift ;;
    *) echo "gpu_table.sh: unknown argument $1 (--prepare, --smoke, --bench, --bench-only, --limit S)"; exit 2 ;;
  esac; shift
done
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
D=${GPU_ASSETS:-$PWD/.gpu}
NAME=fednsam_table2_lenet5_cifar10
CELLS=${CELLS:-*/lenet5_cifar10,*/lenet5_cifar10_to78}; SEEDS=${SEEDS:-3}; PY=${PYTHON:-python3}

if [ $MODE = prepare ]; then
  set -e
  mkdir -p "$D/whl"
  ls "$D"/whl/jsonargparse-*.whl > /dev/null 2>&1 || $PY -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any -d "$D/whl" \
    jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0
  [ -d "$D/staging/cifar-10-batches-py" ] || FEDLIGHT_DATA=${FEDLIGHT_DATA:-../shared/data} \
    $PY tools/data_parts.py cifar10 "$D/staging"  # the JPEG copy, decoded as fedlight decodes it
  # xz at its strongest: minutes of CPU (23 min of wall on a loaded 2-core machine); made once per checkout
  [ -f "$D/parts/cifar-10-batches-py.manifest.json" ] \
    || $PY tools/data_parts.py pack "$D/staging/cifar-10-batches-py" "$D/parts"  # three parts of <= 40 MiB
  ls -l "$D/whl" "$D/parts"; exit 0
fi

OUT=${OUT:-$PWD/gpu_out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
trap 'exec 1>&- 2>&-; sleep 0.5' EXIT  # let tee write the last lines before the call returns
export PYTHONUNBUFFERED=1
if [ $MODE = smoke ]; then
  # a tiny CIFAR-10 ImageFolder of random images, packed and unpacked as the real one is; CPU processes
  D=${SMOKE_DIR:-$(mktemp -d)}
  if [ ! -d "$D/parts" ]; then
    $PY - "$D/src/cifar10-jpeg" <<'PY' || exit 1
import sys
from pathlib import Path

import numpy as np
from PIL import Image

rng = np.random.default_rng(0)
for split, n in (("train", 30), ("test", 6)):
    for c in ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"):
        d = Path(sys.argv[1]) / split / c
        d.mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(d / f"{i:04d}.jpg")
PY
    FEDLIGHT_DATA=$D/src $PY tools/data_parts.py cifar10 "$D/staging" || exit 1
    $PY tools/data_parts.py pack "$D/staging/cifar-10-batches-py" "$D/parts" --part-mib 0.1 || exit 1
  fi
  PER=(--jobs 2); SHRINK=(--shrink "rounds=3,subset=300,test_subset=60,loop.local_epochs=1,loop.clients_per_round=3")
  CELLS=${SMOKE_CELLS:-fednsam/lenet5_cifar10,fednsam/lenet5_cifar10_to78}; SEEDS=${SMOKE_SEEDS:-1}
  TABLE=$D/runs/$NAME; RESTORE_FROM=${RESTORE_FROM:-$D/restore}  # never this checkout's committed runs
else
  if [ ! -d /tmp/site/jsonargparse ]; then
    ls "$D"/whl/*.whl > /dev/null 2>&1 || { echo "no wheels in $D/whl: carry .gpu/whl (made by --prepare)"; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$D"/whl/*.whl || exit 2
  fi
  export PYTHONPATH=/tmp/site:$PWD
  PER=(--per-gpu "${PER_GPU:-auto}"); SHRINK=()
  TABLE=runs/tables/$NAME  # ignored: stays between calls on the same machine
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
    $PY -c "import torch, lightning, jsonargparse; print('torch', torch.__version__, 'lightning', lightning.__version__)"
    git rev-parse --short HEAD; } > "$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
fi
if [ $BENCH != 0 ]; then  # the device benchmark and the CUDA values of the exactness tests (none run on a CPU)
  el "bench ${BENCH_ARGS:-}"
  $PY tools/gpu_lockstep_bench.py $([ $MODE = smoke ] && echo --smoke) ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    > "$OUT/bench.txt" 2>&1
  el "bench exit $?: $(tail -1 "$OUT/bench.txt")"; grep '^ratio\|^step\|^unions' "$OUT/bench.txt"
  [ "${CUDA_TESTS:-1}" = 0 ] || timeout 150 $PY -m pytest -q -p no:cacheprovider -k cuda tests/data/test_gather.py tests/loop/test_round_end.py \
    tests/loop/test_runners.py tests/loop/test_runner_routes.py tests/loop/test_runner_graphed.py \
    tests/loop/test_lockstep.py tests/loop/test_interleave.py tests/loop/test_matmul_convs.py \
    > "$OUT/cuda_tests.txt" 2>&1
  rc=$?; [ "${CUDA_TESTS:-1}" = 0 ] \
    || el "cuda tests exit $rc$([ $rc = 5 ] && echo ': none ran (no CUDA here)'): $(tail -1 "$OUT/cuda_tests.txt")"
  [ $BENCH = 2 ] && exit 0  # --bench-only
fi
export FEDLIGHT_DATA=$D/data FEDLIGHT_CACHE=$D/cache TORCHINDUCTOR_CACHE_DIR=$D/cache/inductor
el "data"
$PY tools/data_parts.py unpack "$D/parts" "$D/data"; rc=$?
if [ $rc = 3 ]; then el "not every part here yet: bring the missing one(s) in the next call (at once: the machine stays warm 30 s)"; exit 0; fi
[ $rc = 0 ] || exit $rc

# Finished runs committed earlier (results/$NAME/runs) count as done on a fresh machine.
$PY - "${RESTORE_FROM:-results/$NAME/runs}" "$TABLE" <<'PY' || exit 1
import shutil, sys
from pathlib import Path

from fedlight.lab.tables.report import finished

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for run in sorted(src.glob("*/*/seed*")) if src.is_dir() else []:
    to = dst / run.relative_to(src)
    if finished(run) and not finished(to) and not (to / "metrics.jsonl").exists():
        shutil.copytree(run, to)
        print(f"restored finished run {to}")
PY
$PY tools/resume_runs.py restore "${RESUME_FROM:-$D/resume}" "$TABLE" || exit 1  # what the last window brought back
# The phases: the stateful rows' cells, then the others (exact cell names, from the spec).
mapfile -t PHASES < <($PY - "$CELLS" "${STATEFUL_ROWS:-scaffold fedgamma fedsmoo}" <<'PY'
import fnmatch, sys

from fedlight.lab.tables.spec import cells, find_spec, load_spec

pats, stateful = [p.strip() for p in sys.argv[1].split(",") if p.strip()], sys.argv[2].split()
names = [c.name for c in cells(load_spec(find_spec("fednsam_table2")))]
chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in pats)]
print(",".join(n for n in chosen if n.split("/")[0] in stateful))
print(",".join(n for n in chosen if n.split("/")[0] not in stateful))
PY
)
LOCK=()
if [ "${LOCKSTEP:-$([ $MODE = smoke ] && echo 0 || echo auto)}" != 0 ]; then
  $PY -m fedlight reproduce --help 2>&1 | grep -q -- '--lockstep' \
    && LOCK=(--lockstep "$([ "${LOCKSTEP:-auto}" = 1 ] && echo on || echo "${LOCKSTEP:-auto}")") \
    || { [ "${LOCKSTEP:-auto}" = 1 ] && { echo "LOCKSTEP=1 but this fedlight reproduce has no --lockstep"; exit 2; }; }
fi
MPSCTL=""  # MPS=1: the runs of this call under an MPS daemon of their own (its pipe under $D/mps), quit after them
if [ "${MPS:-0}" = 1 ]; then
  if [ $MODE != smoke ] && command -v nvidia-cuda-mps-control > /dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=$D/mps/pipe CUDA_MPS_LOG_DIRECTORY=$D/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then MPSCTL=nvidia-cuda-mps-control; el "MPS: a daemon for this call's runs"
    else unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; el "MPS: the daemon did not start; the runs go on without it"; fi
  else
    el "MPS: not used (no nvidia-cuda-mps-control here)"
  fi
fi
ROUNDS=$([ $MODE = smoke ] && echo 3 || echo 1000)
el "table: cells $CELLS, $SEEDS seed(s), ${PER[*]} ${LOCK[*]}; stateful first: ${PHASES[0]:-none}"
RESERVE=45  # the table, the curves and both packs after the stop (2026-11-28, before the resume pack: 11 s)
phase() {  # CELLS SECONDS [--lockstep MODE]: one phase's runs through `fedlight reproduce`, stopped after SECONDS
  local cells=$1 seconds=$2; shift 2
  timeout -s TERM -k 40 $seconds $PY -m fedlight reproduce fednsam_table2 --cells "$cells" --seeds "$SEEDS" \
    "${PER[@]}" "$@" "${SHRINK[@]}" --out "$TABLE" --fit-args "${FIT_ARGS:---loop.save_every 25}"
}
rc=0; RAN=0
for phase in 0 1; do
  cells=${PHASES[$phase]:-}; [ -n "$cells" ] || continue
  BUDGET=$(( LIMIT - ($(date +%s) - T0) - RESERVE ))
  SPR=${STATEFUL_S_PER_ROUND:-$([ $MODE = smoke ] && echo 0)}
  if [ $phase = 0 ] && { [ -z "$SPR" ] || ! awk -v n=$ROUNDS -v s="$SPR" -v b=$BUDGET 'BEGIN{exit !(n*s <= b)}'; }; then
    el "stateful rows not started: $ROUNDS rounds at ${SPR:-an unmeasured} s/round do not fit the $BUDGET s left" \
       "(their client states cannot come back; set STATEFUL_S_PER_ROUND from a measured window)"
    continue
  fi
  if [ $BUDGET -le 10 ]; then el "no time left for runs (limit $LIMIT s)"; rc=1; break; fi
  RAN=1
  phase "$cells" $BUDGET "${LOCK[@]}"; rc=$?
  el "reproduce exit $rc$([ $rc = 124 ] || [ $rc = 143 ] && echo ': stopped at the limit; the next call resumes')"
  BUDGET=$(( LIMIT - ($(date +%s) - T0) - RESERVE ))
  if [ $rc != 0 ] && [ $rc != 124 ] && [ $rc != 143 ] && [ ${#LOCK[@]} != 0 ] && [ $BUDGET -gt 30 ]; then
    # a lockstep failure must not cost the window: the phase again as separate processes (its runs resume)
    el "the phase failed in lockstep (exit $rc): again with --lockstep off for the $BUDGET s left"
    phase "$cells" $BUDGET --lockstep off; rc=$?; el "reproduce (lockstep off) exit $rc"
  fi
  [ $rc = 0 ] || break
done
[ -n "$MPSCTL" ] && { echo quit | $MPSCTL; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; el "MPS: daemon stopped"; }
[ $RAN = 1 ] || rc=1
if [ $rc != 0 ] || [ ! -f "$TABLE/table.md" ]; then  # stopped (or a run failed): the table of what has finished
  $PY -m fedlight reproduce fednsam_table2 --cells "$CELLS" --seeds "$SEEDS" "${SHRINK[@]}" --out "$TABLE" \
    --table-only > "$OUT/table_log.txt" 2>&1
  tail -1 "$OUT/table_log.txt"
fi

el "pack"
P=$D/pack/results/$NAME; rm -rf "$D/pack"; mkdir -p "$P"
$PY - "$TABLE" "$P" <<'PY' || exit 1
import shutil, sys
from pathlib import Path

from fedlight.lab.tables.report import finished

table, dst = Path(sys.argv[1]), Path(sys.argv[2])
for f in [*table.glob("table.*"), *table.glob("*.png")]:
    shutil.copy2(f, dst)
for run in sorted(table.glob("*/*/seed*")):  # finished runs only: an unfinished one resumes from its checkpoint here
    if finished(run):
        (dst / "runs" / run.relative_to(table)).mkdir(parents=True)
        for name in ("metrics.jsonl", "summary.json", "config.yaml", "reproduce.json"):
            if (run / name).is_file():
                shutil.copy2(run / name, dst / "runs" / run.relative_to(table) / name)
PY
tar -C "$D/pack" -czf "$OUT/table.tar.gz" results || exit 1
el "wrote $OUT/table.tar.gz ($(du -h "$OUT/table.tar.gz" | cut -f1)): $(find "$P/runs" -name summary.json 2>/dev/null | wc -l) finished runs"
$PY tools/resume_runs.py pack "$TABLE" "$OUT" --parts "${RESUME_PARTS:-4}" || exit 1  # the unfinished ones
el "packed"

#!/usr/bin/env bash
# Run multi-process tests N times in a row under load (a CPU hog on the second core), one line per run.
# Usage: tools/mp_loop.sh N TEST_ID...   (from the repository root, with PYTHONPATH set to it)
n=$1; shift
nice -n 0 python -c 'while 1: pass' & hog=$!
trap 'kill $hog' EXIT
for i in $(seq "$n"); do
  for t in "$@"; do
    if python -m pytest -q -p no:cacheprovider "$t" > /tmp/mp_loop_last.log 2>&1; then echo "run $i PASS $t";
    else echo "run $i FAIL $t"; cp /tmp/mp_loop_last.log "/tmp/mp_loop_fail_$i.log"; fi
  done
done

#!/usr/bin/env bash
# Run the multi-process tests N times in a row under load (a CPU hog on the second core); count passes and failures.
# Usage: tools/mp_loop.sh N TEST_ID...   (from the repository root, with PYTHONPATH set to it)
n=$1; shift
nice -n 0 python -c 'while 1: pass' & hog=$!
trap 'kill $hog' EXIT
for t in "$@"; do
  pass=0; fail=0
  for i in $(seq "$n"); do
    if python -m pytest -q -p no:cacheprovider "$t" > /tmp/mp_loop_last.log 2>&1; then pass=$((pass+1));
    else fail=$((fail+1)); cp /tmp/mp_loop_last.log "/tmp/mp_loop_fail_$fail.log"; fi
  done
  echo "$t: $pass passed, $fail failed of $n"
done

#!/usr/bin/env bash
# Run the multi-process tests N times in a row under load (a CPU hog on the second core): each iteration is one
# pytest process over every test id given (each test starts its own ranks), one line per test per iteration, and a
# failing iteration's log is kept as /tmp/mp_loop_fail_<i>.log. Ends with "N passes, M failures".
# Usage: tools/mp_loop.sh N TEST_ID...   (from the repository root, with fedlight importable)
n=$1; shift
nice -n 0 python -c 'while 1: pass' & hog=$!
trap 'kill $hog' EXIT
pass=0; fail=0
for i in $(seq "$n"); do
  start=$(date +%s)
  python -m pytest -q -rA -p no:cacheprovider "$@" > /tmp/mp_loop_last.log 2>&1
  for t in "$@"; do
    if grep -q "^PASSED $t\$" /tmp/mp_loop_last.log; then echo "run $i PASS $t"; pass=$((pass + 1));
    else echo "run $i FAIL $t"; fail=$((fail + 1)); cp /tmp/mp_loop_last.log "/tmp/mp_loop_fail_$i.log"; fi
  done
  echo "run $i took $(( $(date +%s) - start )) s"
done
echo "$pass passes, $fail failures"

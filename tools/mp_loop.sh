#!/usr/bin/env bash
# Run the multi-process tests N times in a row under load: each iteration is one pytest process over every test id
# given (each test starts its own ranks), one line per test per iteration; a failing iteration's log is kept as
# /tmp/mp_loop_fail_<pid>_<i>.log. Ends with "N passes, M failures".
# The load: a CPU hog on the second core (MP_LOOP_HOG=0: none, e.g. when two loops over different tests run side by
# side and load each other). MP_LOOP_FIRST: the first iteration's number (to continue a count).
# Usage: tools/mp_loop.sh N TEST_ID...   (from the repository root, with fedlight importable)
n=$1; shift
if [ "${MP_LOOP_HOG:-1}" != 0 ]; then
  nice -n 0 python -c 'while 1: pass' & hog=$!
  trap 'kill $hog' EXIT
fi
log=/tmp/mp_loop_last_$$.log
pass=0; fail=0; first=${MP_LOOP_FIRST:-1}
for i in $(seq "$first" $((first + n - 1))); do
  start=$(date +%s)
  python -m pytest -q -rA -p no:cacheprovider "$@" > "$log" 2>&1
  for t in "$@"; do
    if grep -q "^PASSED $t\$" "$log"; then echo "run $i PASS $t"; pass=$((pass + 1));
    else echo "run $i FAIL $t"; fail=$((fail + 1)); cp "$log" "/tmp/mp_loop_fail_$$_$i.log"; fi
  done
  echo "run $i took $(( $(date +%s) - start )) s ($(date +%H:%M:%S), load $(cut -d' ' -f1 /proc/loadavg))"
done
echo "$pass passes, $fail failures"

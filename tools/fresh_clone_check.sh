#!/usr/bin/env bash
# The README's two commands in a throw-away venv on a fresh clone, timed (a contributor's check before a submission).
# Usage: git clone -q . ../fresh && python -m venv ../fresh/.venv && tools/fresh_clone_check.sh ../fresh
# (the clone beside this one, so that ../shared/data resolves); writes result.txt, install.log, quickstart.log,
# freeze.txt and pytest.log in the clone.
set -uo pipefail
cd "$1"
source .venv/bin/activate
export FEDLIGHT_CACHE="$(mktemp -d)"
t0=$(date +%s)
python -m pip install --quiet --upgrade pip
pip install -e ".[dev]" > install.log 2>&1 && fedlight fit --config recipes/quickstart.yaml > quickstart.log 2>&1
echo "cmd1 rc=$? $(( $(date +%s) - t0 )) s" > result.txt
pip freeze > freeze.txt
t1=$(date +%s)
FEDLIGHT_DATA=../shared/data python -m pytest tests -q -p no:cacheprovider > pytest.log 2>&1
echo "cmd2 rc=$? $(( $(date +%s) - t1 )) s" >> result.txt

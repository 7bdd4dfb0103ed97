#!/usr/bin/env bash
# Line coverage of grpo_cli/ by a tree's CI selection (make test + make test-ci), subprocesses and xdist workers included
# (coverage's patch=subprocess; pytest-cov is not used: under xdist with that patch it recorded no line).
#   scripts/suite_coverage.sh TREE OUT [pytest args, e.g. -n 2 --dist loadfile]
# TREE has its own .venv with coverage>=7.10 installed (pip install --no-deps coverage); OUT gets report.txt, cov.json.
# Compare two trees with scripts/coverage_compare.py OUT_BEFORE/cov.json OUT_AFTER/cov.json (docs/development.md).
set -u
TREE=$1
OUT=$2
shift 2
mkdir -p "$OUT"
rm -f "$OUT"/.coverage*
cat > "$OUT/rc" <<RC
[run]
source = grpo_cli
parallel = true
patch = subprocess
data_file = $OUT/.coverage
RC
cd "$TREE" || exit 1
export COVERAGE_RCFILE="$OUT/rc"
.venv/bin/python -m coverage run --rcfile="$OUT/rc" -m pytest -q -p no:cov -m "not slow or ci" "$@" > "$OUT/pytest.log" 2>&1
echo "pytest exit $?" >> "$OUT/pytest.log"
.venv/bin/python -m coverage combine --rcfile="$OUT/rc" -q
.venv/bin/python -m coverage report --rcfile="$OUT/rc" > "$OUT/report.txt"
.venv/bin/python -m coverage json --rcfile="$OUT/rc" -o "$OUT/cov.json" -q
tail -1 "$OUT/report.txt"

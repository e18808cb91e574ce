#!/usr/bin/env bash
# FedDEO on the generator that knows domains (fmnist-tiny-dom) against the controls that
# separate its mechanisms, under feature skew, over several seeds:
#
#   bash benchmarks/feddeo_domains.sh   # OUT=benchmarks/results/compare_feddeo_dom_cpu SEEDS="0 1 2"
#
# Runs configs/compare/compare_feddeo_dom_cpu.toml into OUT/seed<s>: by default its generating
# methods only (FedDEO with its descriptions-only control, Prompts-Only at w_t 3 and 6, the
# Oracle), three at once; ONLY="" runs every method, the FedAvg classifier and the Ceiling
# too (otherwise benchmarks/feddeo_domains.py takes those two from
# benchmarks/results/compare_feddeo_cpu/seed<s>, the same split, model and recipe). Then
# writes OUT/table.{md,json}, OUT/accuracy_seeds.png and OUT/grids_seed<first>.png
# (benchmarks/feddeo_domains.py). A method that finished keeps its record, so a rerun picks
# up where an interrupted one stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/compare_feddeo_dom_cpu}
SEEDS=${SEEDS:-"0 1 2"}
ONLY=${ONLY-"FedDEO Prompts-Only Oracle"}
JOBS=${JOBS:-3}
ESTUARY=${ESTUARY:-"python -m estuary"}

only=()
for m in $ONLY; do only+=(--only "$m"); done
for s in $SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare configs/compare/compare_feddeo_dom_cpu.toml \
    --out "$OUT/seed$s" --jobs "$JOBS" --no-table "${only[@]}"
  echo "seed $s: done ($(date -u +%H:%M:%S))"
done
python benchmarks/feddeo_domains.py "$OUT"

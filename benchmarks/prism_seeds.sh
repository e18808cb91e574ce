#!/usr/bin/env bash
# PRISM's MADA comparison over three seeds on the CPU (configs/compare/compare_prism_mada_cpu.toml:
# FedAvg matched to PRISM's optimizer, PRISM, PRISM without MADA, PRISM with a fixed lambda),
# then the table over seeds:
#
#   bash benchmarks/prism_seeds.sh            # OUT=runs/prism-mada SEEDS="0 1 2" JOBS=2
#
# Each seed is one comparison in OUT/seed<s> (its own key, split and draws); a seed that was
# interrupted picks up where it stopped (finished methods are reused). Writes the table and
# the plots over seeds into OUT (benchmarks/prism_seeds.py). About 35 minutes of CPU per
# method and seed at one thread.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/prism-mada}
SEEDS=${SEEDS:-"0 1 2"}
JOBS=${JOBS:-2}
CFG=configs/compare/compare_prism_mada_cpu.toml
ESTUARY=${ESTUARY:-"python -m estuary"}

for s in $SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare "$CFG" --out "$OUT/seed$s" --jobs "$JOBS"
  echo "seed $s done ($(date -u +%H:%M:%S))"
done
python benchmarks/prism_seeds.py "$OUT"

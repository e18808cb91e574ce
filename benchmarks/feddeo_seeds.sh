#!/usr/bin/env bash
# FedDEO against Prompts-Only, the FedAvg classifier and the Ceiling on Fashion-MNIST domains,
# over several seeds, plus the N / E / w_d ablations and the label-skew variant, on the CPU
# (about 45 minutes of both cores):
#
#   bash benchmarks/feddeo_seeds.sh     # OUT=benchmarks/results/compare_feddeo_cpu SEEDS="0 1 2"
#
# Writes OUT/seed<s> (configs/compare/compare_feddeo_cpu.toml), OUT/ablation-seed<s>
# (compare_feddeo_ablation_cpu.toml, seeds ABLATION_SEEDS), OUT/labelskew-seed<s>
# (compare_feddeo_labelskew_cpu.toml, seeds LABEL_SEEDS), OUT/wd-seed<s>
# (compare_feddeo_wd_cpu.toml, seeds WD_SEEDS) and the table over seeds
# OUT/table.{md,json}, OUT/accuracy_seeds.png (benchmarks/feddeo_seeds.py). A method that
# finished keeps its record, so a rerun picks up where an interrupted one stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/compare_feddeo_cpu}
SEEDS=${SEEDS:-"0 1 2"}
ABLATION_SEEDS=${ABLATION_SEEDS:-"0"}
LABEL_SEEDS=${LABEL_SEEDS:-"0"}
WD_SEEDS=${WD_SEEDS:-"0"}
ESTUARY=${ESTUARY:-"python -m estuary"}

for s in $SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare configs/compare/compare_feddeo_cpu.toml \
    --out "$OUT/seed$s" --quiet
  echo "seed $s: feature skew done ($(date -u +%H:%M:%S))"
done
for s in $ABLATION_SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare configs/compare/compare_feddeo_ablation_cpu.toml \
    --out "$OUT/ablation-seed$s" --quiet
  echo "seed $s: ablations done ($(date -u +%H:%M:%S))"
done
for s in $LABEL_SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare configs/compare/compare_feddeo_labelskew_cpu.toml \
    --out "$OUT/labelskew-seed$s" --quiet
  echo "seed $s: label skew done ($(date -u +%H:%M:%S))"
done
for s in $WD_SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare configs/compare/compare_feddeo_wd_cpu.toml \
    --out "$OUT/wd-seed$s" --quiet
  echo "seed $s: w_d sweep done ($(date -u +%H:%M:%S))"
done
python benchmarks/feddeo_seeds.py "$OUT"

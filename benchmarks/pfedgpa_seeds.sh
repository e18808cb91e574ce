#!/usr/bin/env bash
# pFedGPA against Local-only and FedAvg(-FT) over several seeds at the paper's 200 rounds, on
# the CPU, in about a third less time than three full compare runs:
#
#   bash benchmarks/pfedgpa_seeds.sh            # OUT=runs/pfedgpa-seeds SEEDS="0 1 2"
#   CFG=configs/compare/compare_pfedgpa_small_cpu.toml FORK=170 ARMS=pFedGPA \
#     OUT=runs/pfedgpa-small bash benchmarks/pfedgpa_seeds.sh     # whole-model generation
#
# Until its last round pFedGPA trains exactly as FedAvg does (same seed, same global model
# every round: checked bit for bit in the per-round model hashes), so its two runs (inversion,
# and direct generation, the ablation) start from FedAvg's checkpoint at round FORK (model.init)
# and run the remaining 200 - FORK rounds, enough to fill its store of the last 20 rounds.
# The devices' data order in those rounds differs from FedAvg's (a run counts its rounds from
# 0), so they are a statistically equal continuation, not a copy. A full 200-round compare
# of one seed (estuary compare configs/compare/compare_pfedgpa_cpu.toml) checks the fork.
# Writes OUT/seed<s> (Local-only, FedAvg), OUT/seed<s>-fork (pFedGPA, pFedGPA direct) and the
# table over seeds OUT/table.{md,json} (benchmarks/pfedgpa_seeds.py). ARMS="pFedGPA" forks the
# inverting run only: both arms train the same diffusion model (same store, same seed), so
# benchmarks/pfedgpa_inversion.py scores direct generation (and every depth) from its files,
# OUT/seed<s>-fork/sweep, and the table takes the direct row from there.
# PHASES="baselines forks table" (default: all three) picks what to run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/pfedgpa-seeds}
SEEDS=${SEEDS:-"0 1 2"}
FORK=${FORK:-150}  # a multiple of the config's eval.checkpoint_every (50)
ROUNDS=200         # the config's run.rounds
JOBS=${JOBS:-2}
CFG=${CFG:-configs/compare/compare_pfedgpa_cpu.toml}
ARMS=${ARMS:-"pFedGPA|pFedGPA, direct"}
PHASES=${PHASES:-"baselines forks table"}
ESTUARY=${ESTUARY:-"python -m estuary"}
IFS='|' read -r -a arms <<< "$ARMS"
only=()
for a in "${arms[@]}"; do only+=(--only "$a"); done

[[ " $PHASES " == *" baselines "* ]] && for s in $SEEDS; do
  ESTUARY__RUN__SEED=$s $ESTUARY compare "$CFG" --out "$OUT/seed$s" --only Local-only --only FedAvg \
  --jobs "$JOBS" --no-table --quiet
  echo "seed $s: Local-only and FedAvg done ($(date -u +%H:%M:%S))"
done
[[ " $PHASES " == *" forks "* ]] && for s in $SEEDS; do
  ckpt="$OUT/seed$s/fedavg/checkpoints/round_$(printf %06d "$FORK").safetensors"
  test -f "$ckpt" || { echo "no FedAvg checkpoint at round $FORK: $ckpt" >&2; exit 1; }
  ESTUARY__RUN__SEED=$s ESTUARY__RUN__ROUNDS=$((ROUNDS - FORK)) ESTUARY__MODEL__INIT="$(realpath "$ckpt")" \
    $ESTUARY compare "$CFG" --out "$OUT/seed$s-fork" "${only[@]}" \
    --jobs "$JOBS" --no-table --quiet
  echo "seed $s: pFedGPA forked at round $FORK done ($(date -u +%H:%M:%S))"
  if [[ ${#arms[@]} == 1 ]]; then
    python benchmarks/pfedgpa_inversion.py "$OUT/seed$s-fork/pfedgpa" --out "$OUT/seed$s-fork/sweep"
  fi
done
[[ " $PHASES " == *" table "* ]] && python benchmarks/pfedgpa_seeds.py "$OUT" --fork "$FORK"
true

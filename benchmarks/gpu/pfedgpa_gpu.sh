#!/usr/bin/env bash
# pFedGPA as the paper runs it on Fashion-MNIST, on one GPU, in one command: the classifier
# and parameter-diffusion tests on the GPU (reported, a gate for nothing), then
# configs/compare/compare_pfedgpa_cpu.toml with the whole model generated (pfedgpa_layers =
# ["*"], p-diff's medium autoencoder, 117,066 parameters per vector) and the diffusion model
# trained on the GPU, four methods sharing it, for the time that is left. Every method keeps
# its metrics.jsonl; the table is written when all four finish.
#
#   OUT=/path/to/results bash benchmarks/gpu/pfedgpa_gpu.sh     # on the GPU machine
#
# Needs the wheels and the Fashion-MNIST files next to the checkout (`.whl/`, `.fmnist/`;
# docs/results.md, "Running the GPU comparison"). Environment:
#   OUT       where results go (pfedgpa_gpu.tar.gz: logs, metrics, tables, plots)
#   BUDGET_S  seconds for the whole script (default 480)
#   ROUNDS    rounds of every method (default 200, the paper's)
#   DRY_RUN=1 rehearse on a CPU machine: 3 rounds, a diffusion model of a few steps, no wheels
#   SKIP_TESTS=1 straight to the comparison
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUDGET_S=${BUDGET_S:-480}
start=$SECONDS
mkdir -p "$OUT"
run=${RUN_DIR:-runs/pfedgpa-gpu}
rm -rf "$run"
export PYTHONUNBUFFERED=1
export ESTUARY__RUN__ROUNDS=${ROUNDS:-200} ESTUARY__ALGORITHM__PFEDGPA__AE_SIZE=medium \
  ESTUARY__ALGORITHM__PFEDGPA__LAYERS='["*"]' ESTUARY__ALGORITHM__PFEDGPA__AE_STEPS=2000 \
  ESTUARY__ALGORITHM__PFEDGPA__DM_STEPS=2000
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  export ESTUARY__RUN__ROUNDS=3 ESTUARY__ALGORITHM__PFEDGPA__AE_STEPS=2 \
    ESTUARY__ALGORITHM__PFEDGPA__DM_STEPS=2 ESTUARY__ALGORITHM__PFEDGPA__STORE_ROUNDS=2
  tests=(--collect-only)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site ESTUARY_FMNIST_DIR=$PWD/.fmnist ESTUARY__COMPUTE__DEVICE=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  tests=()
fi

[[ "${SKIP_TESTS:-0}" == 1 ]] || timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 "${tests[@]}" \
  tests/test_param_diffusion.py tests/test_classifiers.py 2>&1 | tee "$OUT/tests.log"

left=$((BUDGET_S - (SECONDS - start) - 15))
echo "[pfedgpa_gpu] ${left}s left for the comparison"
timeout --signal=INT --kill-after=10 "$left" python3 -m estuary compare \
  configs/compare/compare_pfedgpa_cpu.toml --jobs 4 --out "$run" 2>&1 | tee "$OUT/compare.log"
tar czf "$OUT/pfedgpa_gpu.tar.gz" --exclude='*.safetensors' "$run"
echo "[pfedgpa_gpu] done in $((SECONDS - start))s"

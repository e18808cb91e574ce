#!/usr/bin/env bash
# PRISM on the paper's ResNet generator (ngf = 64) on one GPU, in one command: the one-shot
# and matching-network tests on the GPU (a gate for nothing, reported), then
# configs/compare/compare_prism_resnet_gpu.toml (FedAvg on the weights at two learning rates,
# matched to PRISM's optimizer; PRISM; PRISM-dagger; four processes sharing the GPU) for the
# time that is left. A comparison stopped by the
# budget keeps every method's metrics.jsonl (quality every 5 rounds): compare the methods at
# equal rounds with `python benchmarks/gpu/prism_resnet_report.py DIR`, which also picks FedAvg's
# learning rate on its training loss over the first rounds.
#
#   OUT=/path/to/results bash benchmarks/gpu/prism_resnet_gpu.sh     # on the GPU machine
#
# Needs the wheels and the Fashion-MNIST files next to the checkout (`.whl/` with opacus too,
# `.fmnist/`; docs/results.md, "Running the GPU comparison"). Environment:
#   OUT       where results go (prism_resnet_gpu.tar.gz: logs, metrics, sample grids, tables)
#   BUDGET_S  seconds for the whole script (default 480)
#   DRY_RUN=1 rehearse on a CPU machine: 2 rounds of 2 local steps, no wheels
#   ONLY      run only these methods of the comparison (labels, comma-separated)
#   SKIP_TESTS=1 straight to the comparison
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUDGET_S=${BUDGET_S:-480}
start=$SECONDS
mkdir -p "$OUT"
run=${RUN_DIR:-runs/prism-resnet-gpu}
rm -rf "$run"
export PYTHONUNBUFFERED=1
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  export ESTUARY__RUN__ROUNDS=2 ESTUARY__TRAIN__LOCAL_STEPS=2 ESTUARY__ALGORITHM__PRISM__LOCAL_ITERS=2 \
    ESTUARY__EVAL__EVERY=1 ESTUARY__EVAL__NUM_SAMPLES=50 ESTUARY__EVAL__NUM_REFERENCE=100
  tests=(--collect-only)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site ESTUARY_FMNIST_DIR=$PWD/.fmnist ESTUARY__COMPUTE__DEVICE=cuda
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  tests=()
fi

[[ "${SKIP_TESTS:-0}" == 1 ]] || timeout 120 python3 -m pytest -q -p no:cacheprovider -n 0 "${tests[@]}" tests/test_oneshot.py \
  tests/test_feature_match.py 2>&1 | tee "$OUT/tests.log"

only=()
IFS=',' read -ra labels <<< "${ONLY:-}"
for label in "${labels[@]}"; do only+=(--only "$label"); done
left=$((BUDGET_S - (SECONDS - start) - 15))
echo "[prism_resnet_gpu] ${left}s left for the comparison"
timeout --signal=INT --kill-after=10 "$left" python3 -m estuary compare \
  configs/compare/compare_prism_resnet_gpu.toml --jobs 4 "${only[@]}" --out "$run" 2>&1 | tee "$OUT/compare.log"
python3 benchmarks/gpu/prism_resnet_report.py "$run" 2>&1 | tee "$OUT/report.md"
tar czf "$OUT/prism_resnet_gpu.tar.gz" --exclude='*.safetensors' --exclude='prism.key' "$run"
echo "[prism_resnet_gpu] done in $((SECONDS - start))s"

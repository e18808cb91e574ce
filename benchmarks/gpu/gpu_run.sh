#!/usr/bin/env bash
# A GPU run with a time budget, in one command: check that compute.deterministic repeats a GPU
# run bit for bit (reported, not a gate), check the CUDA-graph training paths (per-round
# captures, then the resident capture kept across rounds, each with its own gate), time their
# per-step and per-round costs on fmnist-tiny (under a minute), then run FedPhD's comparison
# (benchmarks/gpu/gpu_compare.py) with what passed (eagerly if the graph tests fail) in the
# time that is left.
#
#   OUT=/path/to/results bash benchmarks/gpu/gpu_run.sh        # on the GPU machine
#
# Needs the wheels and the Fashion-MNIST files next to the checkout (`.whl/`, `.fmnist/`: how
# to prepare them is in docs/results.md, "Running the GPU comparison"). Environment:
#   OUT       where results go
#   BUDGET_S  seconds for the whole script (default 560: a 600 s command with a margin)
#   PRESET    the comparison's U-Net (default fmnist-tiny; fmnist-small is the comparison's own)
#   DRY_RUN=1 rehearse on a CPU machine: the GPU tests only collected, the benchmark and the
#             comparison in their CPU rehearsal modes (about 5 minutes with BUDGET_S=300)
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
BUDGET_S=${BUDGET_S:-560}
PRESET=${PRESET:-fmnist-tiny}
start=$SECONDS
mkdir -p "$OUT"

export PYTHONUNBUFFERED=1
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  pytest_args=(--collect-only) bench_args=(--device cpu --presets fmnist-tiny --batch 16
    --steps 6 --long-steps 12 --repeats 1) compare_args=(--dry-run)
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/site ESTUARY_FMNIST_DIR=$PWD/.fmnist
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  pytest_args=() compare_args=(--preset "$PRESET")
  bench_args=(--presets fmnist-tiny --repeats 3 --steps 24 --long-steps 96)
fi

# compute.deterministic: two GPU runs must end on the same bits (not a gate: reported only)
timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 "${pytest_args[@]}" \
  tests/test_determinism.py 2>&1 | tee "$OUT/gpu_tests.log"

graph=()
if timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 "${pytest_args[@]}" \
    -k "not resident" tests/test_graphed.py 2>&1 | tee -a "$OUT/gpu_tests.log"; then
  graph=(--cuda-graph)
  # the resident capture (train.cuda_graph_reuse) has its own gate: graphs without it else
  if timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -n 0 "${pytest_args[@]}" \
      -k resident tests/test_graphed.py 2>&1 | tee -a "$OUT/gpu_tests.log"; then
    graph+=(--graph-reuse) bench_args+=(--reuse)
  else
    echo "[gpu_run] the resident-capture tests failed: graphs captured per round" | tee -a "$OUT/gpu_tests.log"
  fi
  timeout 75 python3 benchmarks/train_graph.py "${bench_args[@]}" \
    --out "$OUT/train_graph.json" 2>&1 | tee "$OUT/train_graph.log"
else
  echo "[gpu_run] the CUDA-graph tests failed: the comparison trains eagerly" | tee -a "$OUT/gpu_tests.log"
fi

left=$((BUDGET_S - (SECONDS - start)))
echo "[gpu_run] ${left}s left for the comparison (${graph[*]:-eager})"
python3 benchmarks/gpu/gpu_compare.py "${compare_args[@]}" --max-rounds 400 --budget-s "$left" \
  "${graph[@]}" --out "$OUT" 2>&1 | tee "$OUT/driver.log"

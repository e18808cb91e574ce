#!/usr/bin/env bash
# Set up Estuary on a fresh Debian/Ubuntu machine (idempotent; fast when already done):
#   - Fashion-MNIST from Debian's dataset-fashion-mnist (when root and missing),
#   - PyTorch 2.13.0 CPU build first (so no CUDA wheels get pulled in),
#   - the Mosquitto MQTT broker from Debian (when root and missing; else the embedded amqtt
#     broker from the "broker" extra is used),
#   - Prometheus from Debian (when root and missing): the tests run promtool and a real
#     Prometheus server on the shipped alerting rules,
#   - this package in editable mode with the train, dev and broker extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${ESTUARY_FMNIST_DIR:-}" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing Fashion-MNIST (apt: dataset-fashion-mnist)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq dataset-fashion-mnist >/dev/null
  else
    echo "warning: Fashion-MNIST not found; install dataset-fashion-mnist or set ESTUARY_FMNIST_DIR" >&2
  fi
fi

if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing the Mosquitto broker (apt: mosquitto)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends mosquitto >/dev/null
    # we start our own brokers; the packaged system service is not needed
    (systemctl disable --now mosquitto 2>/dev/null || service mosquitto stop 2>/dev/null) || true
  else
    echo "note: mosquitto not found; estuary demo will use the embedded amqtt broker" >&2
  fi
fi

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing Prometheus (apt: prometheus; the rules tests use it)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    # the tests start their own servers; the packaged system service is not needed
    (systemctl disable --now prometheus 2>/dev/null || service prometheus stop 2>/dev/null) || true
  else
    echo "note: prometheus not found; the Prometheus rules tests will be skipped" >&2
  fi
fi

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "==> installing torch==2.13.0 (CPU)"
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi

echo "==> installing estuary (editable, train, dev and broker extras)"
# docker/requirements/cloud.txt pins the versions the images install: test against those
"$PYTHON" -m pip install -q --disable-pip-version-check -c docker/requirements/cloud.txt \
  -e ".[train,dev,broker]"

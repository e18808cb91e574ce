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

# apt-get install the Debian package $1 (what it is: $2) when root, else say $3; we start our
# own servers, so the packaged system service is stopped
install_server_package() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing $2 (apt: $1)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$1" >/dev/null
    (systemctl disable --now "$1" 2>/dev/null || service "$1" stop 2>/dev/null) || true
  else
    echo "note: $1 not found; $3" >&2
  fi
}

if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  install_server_package mosquitto "the Mosquitto broker" \
    "estuary demo will use the embedded amqtt broker"
fi

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  install_server_package prometheus "Prometheus, for the rules tests" \
    "the Prometheus rules tests will be skipped"
fi

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "==> installing torch==2.13.0 (CPU)"
  "$PYTHON" -m pip install -q "torch==2.13.0"
fi

echo "==> installing estuary (editable, train, dev and broker extras)"
# docker/requirements/cloud.txt pins the versions the images install: test against those
"$PYTHON" -m pip install -q --disable-pip-version-check -c docker/requirements/cloud.txt \
  -e ".[train,dev,broker]"

#!/usr/bin/env bash
# Set up Estuary on a fresh Debian/Ubuntu machine (idempotent; fast when already done).
#
#   bash scripts/setup.sh        everything the tests need
#   bash scripts/setup.sh demo   what `estuary demo` needs (no Prometheus server)
#
# What it installs, each only when missing (the Debian packages only when run as root):
#   - Fashion-MNIST from Debian's dataset-fashion-mnist (the demo's and the tests' data),
#   - the Mosquitto MQTT broker from Debian (else the embedded amqtt broker is used),
#   - Prometheus from Debian, for the tests only: they run promtool and a real Prometheus
#     server on the shipped alerting rules,
#   - PyTorch 2.13.0, the CPU build, first (so that no CUDA wheels get pulled in),
#   - this package in editable mode with the train, dev and broker extras.
# One line per step; the package managers' output goes to a log, shown only on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=${1:-tests}
case "$MODE" in
  tests|demo) ;;
  *) echo "usage: bash scripts/setup.sh [tests|demo]" >&2; exit 2 ;;
esac
LOG=$(mktemp -t estuary-setup.XXXXXX.log)
trap 'rm -f "$LOG"' EXIT
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

# run a command with its output in $LOG; on failure show the log's end and stop
quietly() {
  if ! "$@" >"$LOG" 2>&1; then
    echo "setup failed: $*" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
}

as_root() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; }

APT_UPDATED=""
apt_install() {
  if [ -z "$APT_UPDATED" ]; then
    quietly apt-get update -qq
    APT_UPDATED=1
  fi
  quietly apt-get install -y -qq --no-install-recommends "$@"
}

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ] && [ -z "${ESTUARY_FMNIST_DIR:-}" ]; then
  if as_root; then
    echo "==> installing Fashion-MNIST (apt: dataset-fashion-mnist), the data every run uses"
    apt_install dataset-fashion-mnist
  else
    echo "warning: Fashion-MNIST not found; install dataset-fashion-mnist or set ESTUARY_FMNIST_DIR" >&2
  fi
fi

# install the Debian package $1 (what it is and why: $2) when root, else say $3; Estuary
# starts its own servers, so the packaged system service is stopped
install_server_package() {
  if as_root; then
    echo "==> installing $2 (apt: $1)"
    apt_install "$1"
    (systemctl disable --now "$1" >/dev/null 2>&1 || service "$1" stop >/dev/null 2>&1) || true
  else
    echo "note: $1 not found; $3" >&2
  fi
}

if ! command -v mosquitto >/dev/null && [ ! -x /usr/sbin/mosquitto ]; then
  install_server_package mosquitto "the Mosquitto MQTT broker the roles talk through" \
    "estuary demo will use the embedded amqtt broker"
fi

if [ "$MODE" = tests ] && { ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; }; then
  install_server_package prometheus "Prometheus, which the alerting-rules tests run" \
    "the Prometheus rules tests will be skipped"
fi

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  echo "==> installing torch==2.13.0 (the CPU build; a few minutes)"
  quietly "$PYTHON" -m pip install "torch==2.13.0"
fi

echo "==> installing estuary (editable, with the train, dev and broker extras)"
# docker/requirements/cloud.txt pins the versions the images install: test against those
quietly "$PYTHON" -m pip install -c docker/requirements/cloud.txt -e ".[train,dev,broker]"
echo "==> set up ($MODE): $("$PYTHON" -m estuary --version)"

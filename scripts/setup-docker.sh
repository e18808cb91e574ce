#!/usr/bin/env bash
# What the Docker end-to-end test (pytest -m docker, tests/test_docker_e2e.py) needs on a
# Debian/Ubuntu machine, installed when run as root and missing: Docker (docker.io),
# docker-compose v1 and debootstrap. The test starts dockerd itself when none is running
# (and stops it afterwards).
set -euo pipefail
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "==> installing ${missing[*]} (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "error: the docker test needs ${missing[*]}; install them (as root: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

#!/bin/sh
# OS layer of the estuary images, for Debian and Ubuntu bases (debian:bookworm-slim, a
# debootstrap'ed Debian, nvidia/cuda:*-ubuntu24.04): installs the given packages (skipping
# apt when they are all there already, so an air-gapped base image that carries them needs no
# mirror), and creates the unprivileged user estuary (uid/gid 10001) and its directories.
# Usage: os-setup.sh PACKAGE...
set -eu
missing=""
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  # shellcheck disable=SC2086
  apt-get install -y --no-install-recommends $missing
  apt-get clean
  rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb /var/log/apt /var/log/dpkg.log
fi
# uid/gid 10001 may be taken in a site's base image (ubuntu:24.04 ships user ubuntu as 1000)
getent group 10001 >/dev/null || groupadd --gid 10001 estuary
getent passwd 10001 >/dev/null || useradd --uid 10001 --gid 10001 --no-create-home \
  --home-dir /var/lib/estuary --shell /usr/sbin/nologin estuary
for dir in /var/lib/estuary /var/lib/estuary/run /var/lib/estuary/deploy \
    /var/lib/estuary/cache /provision; do
  install -d -o 10001 -g 10001 -m 0750 "$dir"
done

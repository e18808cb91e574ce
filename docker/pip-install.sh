#!/bin/sh
# pip install into the image's virtual environment (/opt/venv) with the build's package
# sources, set by the Dockerfiles' build arguments:
#   PYPI_INDEX_URL        the package index (default https://pypi.org/simple)
#   PYPI_EXTRA_INDEX_URL  extra indexes, space-separated
#   FIND_LINKS            wheel directories or URLs (http://host:port/), space-separated;
#                         docker/wheelhouse/ of the build context is always searched
#   OFFLINE=1             use only FIND_LINKS and docker/wheelhouse/, never an index
#   TRUSTED_HOST          hosts to accept over plain http or self-signed https
# Usage: estuary-pip-install PIP_INSTALL_ARGS...   (an --index-url among them wins over
# PYPI_INDEX_URL: the last one given counts)
set -eu
set -- --no-cache-dir --disable-pip-version-check --no-input --find-links /wheels "$@"
for link in ${FIND_LINKS:-}; do set -- --find-links "$link" "$@"; done
for host in ${TRUSTED_HOST:-}; do set -- --trusted-host "$host" "$@"; done
if [ -n "${PYPI_INDEX_URL:-}" ]; then set -- --index-url "$PYPI_INDEX_URL" "$@"; fi
for url in ${PYPI_EXTRA_INDEX_URL:-}; do set -- --extra-index-url "$url" "$@"; done
if [ "${OFFLINE:-0}" = 1 ]; then
  set -- --no-index "$@"
fi
exec /opt/venv/bin/python -m pip install "$@"

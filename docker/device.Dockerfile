# Estuary device-agent image: local training (PyTorch) and on-device sampling with ONNX
# Runtime's CUDA execution provider, falling back to the CPU provider where no GPU is visible.
# Build from the repository root (docker/compose.yaml does this for you):
#   docker build -f docker/device.Dockerfile -t estuary/device:0.1.0 .
# The default base is NVIDIA's CUDA runtime with cuDNN; PyPI's torch wheel brings its own CUDA
# libraries, and ONNX Runtime loads those when the base lacks them. For CPU-only devices or an
# air-gapped site: --build-arg BASE_IMAGE=<Debian/Ubuntu image> (and TORCH_SPEC/FIND_LINKS/
# OFFLINE, see docker/README.md).
ARG BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS os
ARG WITH_FMNIST=1
ARG ESTUARY_BUILD=""
LABEL io.estuary.build="${ESTUARY_BUILD}"
COPY docker/os-setup.sh /usr/local/sbin/estuary-os-setup
RUN if [ "$WITH_FMNIST" = 1 ]; then data=dataset-fashion-mnist; else data=""; fi; \
    estuary-os-setup python3 ca-certificates $data

FROM os AS builder
ARG PYPI_INDEX_URL=""
ARG PYPI_EXTRA_INDEX_URL=""
ARG FIND_LINKS=""
ARG OFFLINE=0
ARG TRUSTED_HOST=""
# PyPI's Linux torch wheel is the CUDA build (with the nvidia-* runtime wheels); for CPU-only
# devices use TORCH_SPEC="torch==2.13.0+cpu" TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ARG ESTUARY_BUILD=""
LABEL io.estuary.build="${ESTUARY_BUILD}"
RUN estuary-os-setup python3-venv && python3 -m venv /opt/venv
COPY docker/pip-install.sh /usr/local/bin/estuary-pip-install
COPY docker/wheelhouse/ /wheels/
RUN estuary-pip-install --index-url "${TORCH_INDEX_URL:-${PYPI_INDEX_URL:-https://pypi.org/simple}}" \
      --extra-index-url "${PYPI_INDEX_URL:-https://pypi.org/simple}" "${TORCH_SPEC}"
COPY docker/requirements/ /requirements/
RUN estuary-pip-install -r /requirements/device.txt
COPY pyproject.toml README.md /src/
COPY shared /src/shared
COPY cloud /src/cloud
COPY edge_node /src/edge_node
COPY device_agent /src/device_agent
COPY estuary /src/estuary
# --no-deps: estuary asks for onnxruntime, which onnxruntime-gpu replaces (same module)
RUN estuary-pip-install --no-deps --no-build-isolation /src \
    && /opt/venv/bin/python -c "import onnxruntime, torch, device_agent.sampling" \
    && /opt/venv/bin/estuary --help >/dev/null

FROM os AS device
ARG ESTUARY_BUILD=""
LABEL org.opencontainers.image.title="estuary-device" \
      org.opencontainers.image.description="Estuary device agent (training, ONNX Runtime CUDA/CPU sampling)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.estuary.build="${ESTUARY_BUILD}"
COPY --from=builder /opt/venv /opt/venv
COPY docker/healthcheck.py /usr/local/bin/estuary-healthcheck
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    ESTUARY__METRICS__PORT=9100 \
    ESTUARY__DEPLOY__OUT_DIR=/var/lib/estuary/deploy \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /var/lib/estuary
USER 10001:10001
EXPOSE 9100
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=4 \
  CMD ["/opt/venv/bin/python", "/usr/local/bin/estuary-healthcheck"]
ENTRYPOINT ["estuary"]
CMD ["device", "--help"]

# Mosquitto 2 from Debian for Estuary: authenticated clients only, per-role ACL, persistence.
#   docker build -f docker/broker.Dockerfile -t estuary/broker:0.1.0 .
# The built-in config (docker/mosquitto.conf) reads the password file and ACL that
# `estuary provision --out /provision` writes; Kubernetes mounts its own (k8s/base/broker/).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG ESTUARY_BUILD=""
LABEL org.opencontainers.image.title="estuary-broker" \
      org.opencontainers.image.description="Mosquitto MQTT broker for Estuary" \
      org.opencontainers.image.version="0.1.0" \
      io.estuary.build="${ESTUARY_BUILD}"
COPY docker/os-setup.sh /usr/local/sbin/estuary-os-setup
RUN estuary-os-setup mosquitto \
    && install -d -o 10001 -g 10001 -m 0750 /mosquitto /mosquitto/data /mosquitto/config \
    && rm -f /etc/mosquitto/conf.d/*.conf
COPY docker/mosquitto.conf /mosquitto/config/mosquitto.conf
USER 10001:10001
EXPOSE 1883
VOLUME ["/mosquitto/data"]
HEALTHCHECK --interval=5s --timeout=3s --start-period=5s --retries=6 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/1883"]
CMD ["mosquitto", "-c", "/mosquitto/config/mosquitto.conf"]

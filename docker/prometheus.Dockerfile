# Prometheus from Debian, for the compose file (Kubernetes uses prom/prometheus: k8s/).
#   docker build -f docker/prometheus.Dockerfile -t estuary/prometheus:0.1.0 .
# Built from BASE_IMAGE like the other images, so an air-gapped site needs no other registry.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG ESTUARY_BUILD=""
LABEL org.opencontainers.image.title="estuary-prometheus" \
      org.opencontainers.image.description="Prometheus scraping every Estuary role" \
      io.estuary.build="${ESTUARY_BUILD}"
COPY docker/os-setup.sh /usr/local/sbin/estuary-os-setup
RUN estuary-os-setup prometheus \
    && install -d -o 10001 -g 10001 -m 0750 /prometheus
COPY docker/prometheus.yml docker/estuary-rules.yml /etc/prometheus/
USER 10001:10001
EXPOSE 9090
VOLUME ["/prometheus"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=6 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090"]
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus", \
     "--storage.tsdb.retention.time=7d", "--web.listen-address=:9090"]

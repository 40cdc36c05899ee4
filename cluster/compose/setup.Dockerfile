# The compose's one-shot steps (cluster/compose/setup.sh): the node's image, plus a shell
# (dash, staged by cluster/build-image.sh into target/docker/setup) to run them. The node and
# Envoy images stay without one.
ARG BASE=quotamesh:dev
FROM ${BASE}
COPY target/docker/setup/ /
COPY --chown=65534:65534 target/docker/setup-owned/ /
HEALTHCHECK NONE
ENTRYPOINT ["/bin/sh"]
CMD []

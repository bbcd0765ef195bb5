# The gateway: slim, no torch. Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t kvgate-gateway .
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cache ./cache
COPY engine ./engine
COPY gateway ./gateway
COPY region_map ./region_map
COPY perfmodel ./perfmodel
# The base install has no torch: `kvgate serve` never imports the engine.
RUN pip install .
# /models (where compose.yaml mounts the shared model, read-only, for its tokenizer) belongs to kvgate as in
# the engine image, whichever container first mounts the empty named volume.
RUN useradd --system --home /var/lib/kvgate --create-home kvgate \
    && mkdir -p /models && chown kvgate:kvgate /models
USER kvgate
WORKDIR /var/lib/kvgate
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2)" || exit 1
ENTRYPOINT ["kvgate"]
CMD ["serve", "--config", "/etc/kvgate/deploy.toml", "--host", "0.0.0.0"]

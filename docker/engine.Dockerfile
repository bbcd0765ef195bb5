# The engine: torch (a CPU build by default; pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128
# for CUDA). Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t kvgate-engine .
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
RUN pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cache ./cache
COPY engine ./engine
COPY gateway ./gateway
COPY region_map ./region_map
RUN pip install ".[engine]" && useradd --system --home /var/lib/kvgate --create-home kvgate
USER kvgate
WORKDIR /var/lib/kvgate
EXPOSE 8000
ENTRYPOINT ["kvgate"]
CMD ["engine", "--model", "/models/model", "--host", "0.0.0.0", "--port", "8000"]

# The engine: torch, a CPU build by default and then without Triton (the engine's kernels fall back to eager
# torch on CPU tensors). Pass --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 for CUDA: that
# torch brings the Triton it was built with. Build from the repository root:
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
COPY perfmodel ./perfmodel
# The package with its `engine` extra's requirements read from pyproject.toml, less triton (which that extra
# asks for on Linux, for GPUs): the CPU torch installed above satisfies the torch requirement.
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['engine']; print('\n'.join(d for d in deps if not d.startswith('triton')))" > /tmp/engine-requirements.txt \
    && pip install . -r /tmp/engine-requirements.txt && rm /tmp/engine-requirements.txt
# /models belongs to kvgate: an empty named volume mounted there takes this directory's owner, so the
# `model` service of compose.yaml (running as kvgate) can write the model into it.
RUN useradd --system --home /var/lib/kvgate --create-home kvgate \
    && mkdir -p /models && chown kvgate:kvgate /models
USER kvgate
WORKDIR /var/lib/kvgate
EXPOSE 8000
ENTRYPOINT ["kvgate"]
CMD ["engine", "--model", "/models/model", "--host", "0.0.0.0", "--port", "8000"]

# OpenDiLoCo worker / DHT bootstrap image.
#
#   CPU (default):  docker build -t opendiloco .
#   CUDA:           docker build -t opendiloco:cuda \
#                     --build-arg BASE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Behind a proxy, a TLS-inspecting gateway or with a local wheel folder, hand pip its settings at
# build time as optional secrets (nothing of them stays in the image; see docs/deployment.md):
#   docker build --secret id=pip_conf,src=build-pip.conf --secret id=ca_bundle,src=ca.crt .
# `pip_conf` is a pip configuration file (index-url, proxy, find-links, and
# `cert = /run/secrets/ca_bundle` to use the CA bundle); scripts/container_smoke.sh writes one.
# HTTP(S)_PROXY / NO_PROXY build args (predefined, not recorded in the image) reach apt and pip.
#
# The container runs `opendiloco ...` (see docs/deployment.md):
#   docker run -p 31337:31337 -v dht-id:/data/identity opendiloco dht \
#     --swarm.host-maddrs /ip4/0.0.0.0/tcp/31337 --swarm.identity-path /data/identity/bootstrap.key
ARG BASE=python:3.11-slim
FROM ${BASE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# python:*-slim already has Python; a CUDA base (Ubuntu) gets the distribution's python3 + venv.
# Versions are left to the base image's release (they differ per base), hence DL3008.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null || ! python3 -c "import ensurepip" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv

# torch first, pinned, from the index that matches the base (CPU or a CUDA build); the
# constraint keeps the project's own install from swapping it for another build.
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    PIP_CONFIG_FILE=/run/secrets/pip_conf \
    pip install --index-url "${TORCH_INDEX_URL}" --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}" \
    && pip freeze | grep -i '^torch==' > /opt/torch-constraint.txt

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY opendiloco ./opendiloco
RUN --mount=type=secret,id=pip_conf --mount=type=secret,id=ca_bundle \
    PIP_CONFIG_FILE=/run/secrets/pip_conf pip install --constraint /opt/torch-constraint.txt '.[hf]' \
    && python -c "import torch, hivemind, opendiloco; print('torch', torch.__version__, 'hivemind', hivemind.__version__)"
COPY configs ./configs
COPY scripts/join_swarm.sh /usr/local/bin/join_swarm.sh

# A non-root user owns everything the container writes.
RUN useradd --create-home --uid 1000 --shell /usr/sbin/nologin diloco \
    && mkdir -p /data/runs /data/identity /data/swarm /data/cache \
    && chown -R diloco:diloco /data
USER 1000:1000
WORKDIR /data

# Runs (checkpoints and metrics.jsonl: runs/<run_id>/<hostname>/), the peer identity, a folder
# where the bootstrap publishes its address, and the Hugging Face cache.
ENV OPENDILOCO_P2P_PORT=31337 \
    HF_HOME=/data/cache/huggingface
VOLUME ["/data/runs", "/data/identity"]

# The p2p port: listen with --swarm.host-maddrs /ip4/0.0.0.0/tcp/31337 (TCP; add /udp/31337/quic-v1 to use QUIC).
EXPOSE 31337/tcp 31337/udp

# Healthy while the node's p2p port listens (python -m opendiloco.swarm.ops.health --help).
HEALTHCHECK --interval=30s --timeout=20s --start-period=120s --retries=3 \
    CMD ["python", "-m", "opendiloco.swarm.ops.health"]

ENTRYPOINT ["opendiloco"]
CMD ["--help"]

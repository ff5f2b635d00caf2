#!/usr/bin/env bash
# Creates .venv and installs OpenDiLoCo with its test tools. Safe to re-run.
# torch goes in first, pinned, so that nothing pulls a different (CUDA) build of it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e '.[dev]'
# hivemind's p2p daemon comes UPX-packed: unpacked once, each daemon start costs a third less CPU.
.venv/bin/python -m opendiloco.swarm.p2pd_binary
.venv/bin/python -c "import torch, hivemind, opendiloco; print('installed: torch', torch.__version__, '| hivemind', hivemind.__version__, '| opendiloco', opendiloco.__version__)"

#!/usr/bin/env bash
# Creates .venv and installs OpenDiLoCo (the distribution opendiloco-swarm, from this checkout) with
# every extra the tests use. Safe to re-run.
#
# torch goes in first, pinned, so that nothing pulls a different build of it. The default is the
# build pip picks for this machine from the package index; to choose one, set TORCH_SPEC and
# TORCH_INDEX_URL, e.g. a CPU-only build (no CUDA libraries, a much smaller download):
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# or a CUDA 12.8 build:
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
# Supported: Linux on x86-64 (hivemind's p2p daemon ships for it), Python 3.10 or later, torch 2.6 or later.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install -q --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"
else
    .venv/bin/python -m pip install -q "$TORCH_SPEC"
fi
# A distribution named "opendiloco" is either this project under its earlier name or the package
# index's project of that name, whose module is also called opendiloco and would shadow this one's:
# removed first.
if .venv/bin/python -m pip show -q opendiloco >/dev/null 2>&1; then
    .venv/bin/python -m pip uninstall -q -y opendiloco
fi
.venv/bin/python -m pip install -q -e '.[dev]'
# hivemind's p2p daemon comes UPX-packed: an unpacked copy in this project's cache directory costs a
# third less CPU per daemon start (hivemind's own files are left as pip installed them).
.venv/bin/python -m opendiloco.swarm.daemon.p2pd_binary
.venv/bin/python -m pip check
.venv/bin/python -c "import torch, hivemind, opendiloco; print('installed: torch', torch.__version__, '| hivemind', hivemind.__version__, '| opendiloco', opendiloco.__version__)"

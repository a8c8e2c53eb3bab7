#!/usr/bin/env bash
# Creates .venv (if missing) and installs the CPU build of torch, then this project with its test extras.
# torch goes first and pinned: a bare `torch` requirement resolved first would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"

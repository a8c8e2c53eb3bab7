#!/usr/bin/env bash
# Creates .venv (if missing) and installs the CPU build of torch, then this project with its test extras; and
# .venv-executorch, the same torch with this project and ExecuTorch only (tests/test_export.py runs
# `fiber-bundle export --format executorch` there: ExecuTorch's torchao would otherwise be imported by every save).
# torch goes first and pinned: a bare `torch` requirement resolved first would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[test]"
[ -x .venv-executorch/bin/python ] || "$PY" -m venv .venv-executorch
.venv-executorch/bin/python -m pip install --quiet --upgrade pip
.venv-executorch/bin/python -m pip install --quiet "torch==2.13.0"
.venv-executorch/bin/python -m pip install --quiet -e ".[executorch]"

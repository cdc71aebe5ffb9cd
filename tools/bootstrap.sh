#!/usr/bin/env bash
# Set up (idempotently) the project virtualenv `.venv` in the repo root, for CPU (the Triton
# interpreter) and CUDA machines: torch, standard triton, MegaBlocks, stk, this package, and the
# test tools.
#
# MegaBlocks 0.10.0 is an sdist whose build imports torch and whose metadata pins torch<2.7.1;
# with pip's defaults that pulls a multi-GB CUDA torch 2.7.0. So torch goes in first, then
# megablocks and stanford-stk are built against it with --no-build-isolation --no-deps, then
# their real runtime needs. Without CUDA, MegaBlocks' extension is simply not built;
# megablocks_ascend stands in for it.
#
# Env: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0, a CPU build where pip finds
#      one; on a machine where it would fetch a CUDA build you do not want, point pip at PyTorch's
#      CPU wheel index with PIP_EXTRA_INDEX_URL).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
REQS=("$TORCH_SPEC" megablocks==0.10.0 stanford-stk==0.7.1 "triton==3.9.0" numpy packaging
      "pytest>=8" "hypothesis>=6" absl-py matplotlib)
STAMP="$VENV/.megablocks-ascend-reqs"
WANT="${REQS[*]} $(cat "$ROOT/pyproject.toml" | cksum)"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "bootstrap: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check --quiet)
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "bootstrap: installing ${REQS[*]}" >&2
    "${pip[@]}" install "$TORCH_SPEC"
    # --no-build-isolation builds with what the venv has: make sure setuptools is there (venvs of
    # Python 3.12 and later no longer come with it).
    "$VENV/bin/python" -c "import setuptools" 2>/dev/null || "${pip[@]}" install setuptools wheel
    "${pip[@]}" install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1
    "${pip[@]}" install "triton==3.9.0" numpy packaging "pytest>=8" "hypothesis>=6" absl-py matplotlib
    "${pip[@]}" install --no-build-isolation --no-deps -e "$ROOT"
    "$VENV/bin/python" -c "import megablocks_ascend, megablocks; print('bootstrap: megablocks', megablocks.__version__ if hasattr(megablocks, '__version__') else '0.10.0', 'ready')"
    echo "$WANT" > "$STAMP"
else
    echo "bootstrap: $VENV is up to date" >&2
fi

#!/usr/bin/env bash
# Set up (idempotently) a project virtualenv for one point of the supported version matrix, for
# CPU (the Triton interpreter) and CUDA machines: torch, standard triton, MegaBlocks, stk, this
# package, and the test tools.
#
# Usage: tools/bootstrap.sh [POINT]
#   current  (default) .venv          torch 2.13.0 + triton 3.9.0
#   torch27            .venv-torch27  torch 2.7.1 + triton 3.3.1: the torch that torch_npu 2.7.1
#                                     pairs with (PyPI's wheel is a CUDA build, ~3.3 GB with its
#                                     NVIDIA libraries; it runs on a CPU machine)
# CI (.ci/run) tests both points; README.md ("Supported versions") says what each covers.
#
# MegaBlocks 0.10.0 is an sdist whose build imports torch and whose metadata pins torch<2.7.1;
# with pip's defaults that pulls a multi-GB CUDA torch 2.7.0. So torch goes in first, then
# megablocks and stanford-stk are built against it with --no-build-isolation --no-deps, then
# their real runtime needs. Without CUDA, MegaBlocks' extension is simply not built;
# megablocks_ascend stands in for it.
#
# Env: PYTHON (default python3); VENV, TORCH_SPEC, TRITON_SPEC override the point's venv path,
#      torch requirement and triton requirement (where pip would fetch a CUDA build of torch you do
#      not want, point pip at PyTorch's CPU wheel index with PIP_EXTRA_INDEX_URL).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POINT="${1:-current}"
case "$POINT" in
    current) venv="$ROOT/.venv"; torch_spec="torch==2.13.0"; triton_spec="triton==3.9.0" ;;
    torch27) venv="$ROOT/.venv-torch27"; torch_spec="torch==2.7.1"; triton_spec="triton==3.3.1" ;;
    *) echo "bootstrap: unknown point '$POINT' (expected: current, torch27)" >&2; exit 2 ;;
esac
VENV="${VENV:-$venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-$torch_spec}"
TRITON_SPEC="${TRITON_SPEC:-$triton_spec}"
REQS=("$TORCH_SPEC" megablocks==0.10.0 stanford-stk==0.7.1 "$TRITON_SPEC" numpy packaging
      "pytest>=8" "hypothesis>=6" matplotlib)
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
    # --no-build-isolation builds with what the venv has: make sure it has a setuptools that can
    # build wheels itself (>= 70.1). Venvs of Python 3.12 and later have no setuptools; those of
    # 3.11 have 65.5, which needs `wheel` for the editable install; torch >= 2.8 brings a new one.
    "$VENV/bin/python" -c "import setuptools.command.bdist_wheel" 2>/dev/null || "${pip[@]}" install "setuptools>=70.1"
    "${pip[@]}" install --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1
    "${pip[@]}" install "$TRITON_SPEC" numpy packaging "pytest>=8" "hypothesis>=6" matplotlib
    "${pip[@]}" install --no-build-isolation --no-deps -e "$ROOT"
    "$VENV/bin/python" -c "import megablocks_ascend, megablocks, torch, triton; print('bootstrap: torch', torch.__version__, '+ triton', triton.__version__, '+ megablocks 0.10.0 ready')"
    echo "$WANT" > "$STAMP"
else
    echo "bootstrap: $VENV is up to date" >&2
fi

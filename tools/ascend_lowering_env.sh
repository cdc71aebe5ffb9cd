#!/usr/bin/env bash
# Create (idempotently) the lowering virtualenv `.venv-ascend` in the repo root and run the
# Ascend compile gate in it: `python -m megablocks_ascend lower` (triton-ascend's front end, then
# Huawei's bishengir-compile to the hivmc handoff, with each kernel's memory plan checked).
#
# triton-ascend installs its own `triton` package, so it cannot share the project venv
# (`.venv`, standard triton). Pinned set, verified together (docs/notes/ascend-lowering.md):
#   torch==2.13.0 (CPU wheel), triton-ascend==3.2.0, pybind11 (imported by triton-ascend), numpy,
#   and MegaBlocks 0.10.0 + stanford-stk 0.7.1 as a user's Ascend environment has them (built
#   against that torch, --no-deps: see tools/bootstrap.sh), with packaging; ascendnpu-ir==1.2.0
#   (Huawei's bishengir-compile, ~160 MB: the gate finds it inside the wheel, which does not put it
#   on PATH; docs/notes/ascend-backend.md).
# Without an NPU, triton-ascend has no active driver: before the gate, `doctor` checks that the
# plugin and MegaBlocks import there anyway (patch triton-driverless, patches/triton-driverless.md).
#
# Usage: tools/ascend_lowering_env.sh [extra args for `lower`, e.g. --json out.json --dump ir/]
# Env:   PYTHON (default python3)   ASCEND_VENV (default <repo>/.venv-ascend)
#        ASCEND_LOWER_SKIP_RUN=1 only sets the venv up.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASCEND_VENV:-$ROOT/.venv-ascend}"
PYTHON="${PYTHON:-python3}"
REQS=(torch==2.13.0 triton-ascend==3.2.0 pybind11 numpy packaging ascendnpu-ir==1.2.0)
UPSTREAM=(megablocks==0.10.0 stanford-stk==0.7.1)
STAMP="$VENV/.megablocks-ascend-reqs"
WANT="${REQS[*]} ${UPSTREAM[*]}"

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "ascend_lowering_env: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip --quiet --disable-pip-version-check)
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANT" ]]; then
    echo "ascend_lowering_env: installing $WANT" >&2
    "${pip[@]}" install "${REQS[@]}"
    "$VENV/bin/python" -c "import setuptools" 2>/dev/null || "${pip[@]}" install setuptools wheel
    "${pip[@]}" install --no-build-isolation --no-deps "${UPSTREAM[@]}"
    # Fail here, not in the gate, if triton-ascend's triton was replaced by another triton.
    "$VENV/bin/python" -c "import triton.backends.ascend.compiler" >/dev/null
    "$VENV/bin/python" -c "import importlib.util as u, pathlib as p; \
assert (p.Path(u.find_spec('ascendnpuir').submodule_search_locations[0]) / 'bin/bishengir-compile').is_file()"
    echo "$WANT" > "$STAMP"
else
    echo "ascend_lowering_env: $VENV is up to date" >&2
fi

if [[ "${ASCEND_LOWER_SKIP_RUN:-0}" == "1" ]]; then
    exit 0
fi
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The plugin, MegaBlocks and stk import in the Ascend toolchain without an NPU (doctor imports
# all three and fails if they do not).
"$VENV/bin/python" -m megablocks_ascend doctor
exec "$VENV/bin/python" -m megablocks_ascend lower "$@"

#!/usr/bin/env bash
# Set up (idempotently) a project virtualenv for one point of the supported version matrix, for
# CPU (the Triton interpreter) and CUDA machines: torch, standard triton, MegaBlocks, stk, this
# package, and the test tools.
#
# Usage: tools/bootstrap.sh [POINT]
#   current    (default) .venv             torch 2.13.0 + triton 3.9.0
#   torch27              .venv-torch27     torch 2.7.1 + triton 3.3.1: the torch that torch_npu 2.7.1
#                                          pairs with (PyPI's wheel is a CUDA build, ~3.3 GB with its
#                                          NVIDIA libraries; it runs on a CPU machine)
#   llmfoundry           .venv-llmfoundry  current's set plus LLM Foundry 0.22.0 (README.md, "Using
#                                          with LLM Foundry"), and a torchvision stand-in where no
#                                          torchvision importable beside this torch is installed
# CI (.ci/run) tests every point; README.md ("Supported versions") says what each covers.
#
# MegaBlocks 0.10.0 is an sdist whose build imports torch and whose metadata pins torch<2.7.1
# (LLM Foundry's and Composer's too); with pip's defaults that pulls a multi-GB CUDA torch 2.7.0.
# So torch and everything else go in first, then megablocks and stanford-stk are built against
# that torch with --no-build-isolation --no-deps, last. pip would report their pins as conflicts
# ("ERROR: pip's dependency resolver ..."): those installs pass --no-warn-conflicts, and at the end
# `pip check` is run and every unmet requirement that is not one of these known pins is printed.
# Without CUDA, MegaBlocks' extension is simply not built; megablocks_ascend stands in for it.
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
    llmfoundry) venv="$ROOT/.venv-llmfoundry"; torch_spec="torch==2.13.0"; triton_spec="triton==3.9.0" ;;
    *) echo "bootstrap: unknown point '$POINT' (expected: current, torch27, llmfoundry)" >&2; exit 2 ;;
esac
VENV="${VENV:-$venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-$torch_spec}"
TRITON_SPEC="${TRITON_SPEC:-$triton_spec}"
TOOLS=(numpy packaging "pytest>=8" "pytest-xdist>=3" "hypothesis>=6" absl-py matplotlib)
UPSTREAM=(megablocks==0.10.0 stanford-stk==0.7.1)
LLMFOUNDRY=(llm-foundry==0.22.0 mosaicml==0.32.1 mosaicml-streaming==0.12.0)
REQS=("$TORCH_SPEC" "$TRITON_SPEC" "${TOOLS[@]}" "${UPSTREAM[@]}")
STAMP="$VENV/.megablocks-ascend-reqs"
WANT="${REQS[*]} $(cksum < "$ROOT/pyproject.toml")"
if [[ "$POINT" == llmfoundry ]]; then
    REQS+=("${LLMFOUNDRY[@]}")
    WANT="${REQS[*]} $(cat "$ROOT/pyproject.toml" "$ROOT/examples/requirements-llmfoundry.txt" | cksum)"
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    echo "bootstrap: $VENV is up to date" >&2
    exit 0
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "bootstrap: creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
py="$VENV/bin/python"
pip=("$py" -m pip --disable-pip-version-check --quiet)
started=$SECONDS
say() { echo "bootstrap: $*"; }
versions() { "$py" -c 'import sys, importlib.metadata as m; print(", ".join(f"{d} {m.version(d)}" for d in sys.argv[1:]))' "$@"; }

# 1. torch, triton and the test tools. --no-build-isolation (below) builds with what the venv has:
# make sure it has a setuptools that can build wheels itself (>= 70.1). Venvs of Python 3.12 and
# later have no setuptools; those of 3.11 have 65.5, which needs `wheel` for the editable install;
# torch >= 2.8 brings a new one.
"${pip[@]}" install "$TORCH_SPEC" "$TRITON_SPEC" "${TOOLS[@]}"
"$py" -c "import setuptools.command.bdist_wheel" 2>/dev/null || "${pip[@]}" install "setuptools>=70.1"
say "installed $(versions torch triton numpy packaging pytest hypothesis)"

# 2. LLM Foundry (its point only): itself, Composer and Streaming without their dependencies (they
# pin torch 2.7.0), then what they need to train MPT, with torch, triton and numpy held where they are.
if [[ "$POINT" == llmfoundry ]]; then
    "${pip[@]}" install --no-deps --no-warn-conflicts "${LLMFOUNDRY[@]}"
    held="$VENV/.megablocks-ascend-held.txt"
    "$py" -c 'import importlib.metadata as m
for d in ("torch", "triton", "numpy"): print(f"{d}=={m.version(d)}")' > "$held"
    "${pip[@]}" install --no-warn-conflicts -c "$held" -r "$ROOT/examples/requirements-llmfoundry.txt"
    say "installed $(versions llm-foundry mosaicml mosaicml-streaming transformers mlflow-skinny datasets) (+ examples/requirements-llmfoundry.txt)"
    # Composer and Streaming import torchvision; PyPI's x86-64 wheels are CUDA builds that do not
    # import beside a CPU torch. Keep a working torchvision; else the CI stand-in (vision features raise).
    if ! "$py" -c "import torchvision" >/dev/null 2>&1; then
        "$py" -m pip uninstall --quiet --yes torchvision >/dev/null 2>&1 || true
        "${pip[@]}" install --no-deps --no-build-isolation "$ROOT/tools/torchvision-standin"
        rm -rf "$ROOT/tools/torchvision-standin/build"
        say "installed the torchvision stand-in (tools/torchvision-standin: no torchvision that imports beside this torch)"
    fi
fi

# 3. MegaBlocks and stk, built against this torch, without their dependencies (known pins, above).
"${pip[@]}" install --no-build-isolation --no-deps --no-warn-conflicts "${UPSTREAM[@]}"
say "installed $(versions megablocks stanford-stk) (built against this torch; their torch<2.7.1 pin set aside)"

# 4. This package, editable: its torch.backends entry point activates it whatever a program imports first.
"${pip[@]}" install --no-build-isolation --no-deps -e "$ROOT"
say "installed megablocks-ascend $(versions megablocks-ascend | cut -d' ' -f2) (editable, from $ROOT)"

# Every unmet requirement that is not a known pin of MegaBlocks, stk, LLM Foundry, Composer or
# Streaming (torch, numpy, packaging, torchvision, and what LLM Foundry's other features need).
known='^(megablocks|stanford-stk|llm-foundry|mosaicml|mosaicml-streaming) '
unexpected="$("$py" -m pip check 2>/dev/null | grep -Ev "$known" | grep -v '^No broken requirements' || true)"
if [[ -n "$unexpected" ]]; then
    say "WARNING: pip check reports requirements that are not among the known pins:"
    echo "$unexpected" | sed 's/^/bootstrap:   /'
fi
"$py" -c "import megablocks_ascend, megablocks, torch, triton; print('bootstrap: ready: torch', torch.__version__, '+ triton', triton.__version__, '+ megablocks 0.10.0 + megablocks-ascend')"
say "$POINT took $((SECONDS - started)) s"
echo "$WANT" > "$STAMP"

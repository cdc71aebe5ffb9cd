#!/usr/bin/env bash
# Set up (idempotently) a project virtualenv for one point of the supported version matrix, for
# CPU (the Triton interpreter) and CUDA machines: torch, standard triton, MegaBlocks, stk, this
# package, and the test tools.
#
# Usage: tools/bootstrap.sh [POINT]
#   current    (default) .venv             torch 2.14.0 + triton 3.8.0: torch_npu 2.14.0's exact torch
#                                          (PyPI's wheel is a CUDA build, ~3 GB with its NVIDIA
#                                          libraries; it runs on a CPU machine)
#   torch27              .venv-torch27     torch 2.7.1 + triton 3.3.1: the torch that torch_npu 2.7.1
#                                          pairs with (a CUDA build as well)
#   newest               .venv-newest      torch 2.15.0 + triton 3.9.0: the newest torch on PyPI
#   llmfoundry           .venv-llmfoundry  torch 2.13.0 (CPU wheel) + triton 3.9.0 plus LLM Foundry
#                                          0.22.0 (README.md, "Using with LLM Foundry"), and a
#                                          torchvision stand-in where no torchvision importable
#                                          beside this torch is installed
# CI (.ci/run) tests every point; README.md ("Supported versions") says what each covers.
#
# MegaBlocks 0.10.0 is an sdist whose build imports torch and whose metadata pins torch<2.7.1
# (LLM Foundry's and Composer's too); with pip's defaults that pulls a multi-GB CUDA torch 2.7.0.
# So torch and everything else go in first, then megablocks and stanford-stk are built against
# that torch with --no-build-isolation --no-deps, last. pip would report their pins as conflicts
# ("ERROR: pip's dependency resolver ..."): those installs pass --no-warn-conflicts, and at the end
# `pip check` is run and every unmet requirement that is not one of these known pins is printed.
# Without a GPU, MegaBlocks' extension is not built (step 3); megablocks_ascend stands in for it.
#
# Each torch release built for CUDA requires its own Triton (torch 2.14.x: triton~=3.8.0; 2.15.0:
# triton~=3.9.0; 2.7.1: triton==3.3.1), and pip refuses a pair that does not match. So when only
# TORCH_SPEC is overridden, the Triton is the one that torch's own metadata requires (read with
# `pip install --dry-run --no-deps --report`, which fetches metadata, not the wheel); a torch that
# requires none (a CPU build) gets the point's Triton.
#
# pip's configuration may carry constraint files (`constraint = ...` in a pip.conf) that cap torch
# below the point's; then the resolver says "The user requested (constraint) torch<=...". Where the
# dry run shows that, this script says so and installs this venv with PIP_CONSTRAINT=/dev/null,
# which replaces the configured constraint files for its pip commands only (nothing is removed).
#
# Env: PYTHON (default python3); VENV, TORCH_SPEC, TRITON_SPEC override the point's venv path,
#      torch requirement and triton requirement (where pip would fetch a CUDA build of torch you do
#      not want, point pip at PyTorch's CPU wheel index with PIP_EXTRA_INDEX_URL).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POINT="${1:-current}"
case "$POINT" in
    current) venv="$ROOT/.venv"; torch_spec="torch==2.14.0"; triton_spec="triton==3.8.0" ;;
    torch27) venv="$ROOT/.venv-torch27"; torch_spec="torch==2.7.1"; triton_spec="triton==3.3.1" ;;
    newest) venv="$ROOT/.venv-newest"; torch_spec="torch==2.15.0"; triton_spec="triton==3.9.0" ;;
    llmfoundry) venv="$ROOT/.venv-llmfoundry"; torch_spec="torch==2.13.0"; triton_spec="triton==3.9.0" ;;
    *) echo "bootstrap: unknown point '$POINT' (expected: current, torch27, newest, llmfoundry)" >&2; exit 2 ;;
esac
VENV="${VENV:-$venv}"
PYTHON="${PYTHON:-python3}"
# Only the torch overridden: its Triton is decided below, from torch's metadata.
triton_from_torch=0
if [[ -n "${TORCH_SPEC:-}" && -z "${TRITON_SPEC:-}" ]]; then triton_from_torch=1; fi
TORCH_SPEC="${TORCH_SPEC:-$torch_spec}"
TRITON_SPEC="${TRITON_SPEC:-$triton_spec}"
TOOLS=(numpy packaging "pytest>=8" "pytest-xdist>=3" "hypothesis>=6" absl-py matplotlib)
UPSTREAM=(megablocks==0.10.0 stanford-stk==0.7.1)
LLMFOUNDRY=(llm-foundry==0.22.0 mosaicml==0.32.1 mosaicml-streaming==0.12.0)
STAMP="$VENV/.megablocks-ascend-reqs"
want() {  # what the stamp records: the requirements and the files that shape the venv
    REQS=("$TORCH_SPEC" "$TRITON_SPEC" "${TOOLS[@]}" "${UPSTREAM[@]}")
    WANT="${REQS[*]} $(cksum < "$ROOT/pyproject.toml")"
    if [[ "$POINT" == llmfoundry ]]; then
        REQS+=("${LLMFOUNDRY[@]}")
        WANT="${REQS[*]} $(cat "$ROOT/pyproject.toml" "$ROOT/examples/requirements-llmfoundry.txt" | cksum)"
    fi
}
want

if [[ $triton_from_torch -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
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

# What this torch requires of Triton, and whether pip's configuration caps it (see the header).
# Prints the Triton requirement (empty if none) and exits 3 where a configured constraint refused.
torch_meta() {
    local report errors rc=0
    report="$(mktemp)"; errors="$(mktemp)"
    # (not --quiet: with it pip leaves out the line that names a constraint)
    if ! "$py" -m pip --disable-pip-version-check install --dry-run --no-deps --ignore-installed \
            --report "$report" "$TORCH_SPEC" >"$errors" 2>&1; then
        if grep -q "(constraint)" "$errors"; then rc=3; else cat "$errors" >&2; rc=1; fi
    else
        # Markers are evaluated by the packaging that pip vendors (the venv may have none yet).
        "$py" -c '
import json, sys
from pip._vendor.packaging.requirements import Requirement
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if meta["name"].lower() != "torch":
        continue
    for text in meta.get("requires_dist") or []:
        req = Requirement(text)
        if req.name == "triton" and (req.marker is None or req.marker.evaluate({"extra": ""})):
            print(f"triton{req.specifier}")' "$report" || rc=1
    fi
    rm -f "$report" "$errors"
    return $rc
}
set +e
torch_triton="$(torch_meta)"
rc=$?
set -e
if [[ $rc -eq 3 ]]; then
    say "pip's configuration constrains torch below $TORCH_SPEC (a constraint file named in pip.conf); installing this venv with PIP_CONSTRAINT=/dev/null, which sets those constraint files aside for its pip commands"
    export PIP_CONSTRAINT=/dev/null
    torch_triton="$(torch_meta)"
elif [[ $rc -ne 0 ]]; then
    say "pip cannot resolve $TORCH_SPEC (above)"; exit 1
fi
if [[ $triton_from_torch -eq 1 ]]; then
    if [[ -n "$torch_triton" ]]; then
        TRITON_SPEC="$torch_triton"
        say "TORCH_SPEC=$TORCH_SPEC alone: taking the Triton that torch requires, $TRITON_SPEC"
    else
        say "TORCH_SPEC=$TORCH_SPEC requires no Triton (a CPU build): taking the point's, $TRITON_SPEC"
    fi
    want
    if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
        say "$VENV is up to date"
        exit 0
    fi
fi

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
# On a machine without a GPU, MegaBlocks is built without its CUDA extension even where a CUDA
# toolkit is installed (its setup.py would ask the absent GPU for its compute capability and fail:
# tools/no-cuda-extension/sitecustomize.py).
build_env=()
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    build_env=(env "PYTHONPATH=$ROOT/tools/no-cuda-extension${PYTHONPATH:+:$PYTHONPATH}")
fi
"${build_env[@]}" "${pip[@]}" install --no-build-isolation --no-deps --no-warn-conflicts "${UPSTREAM[@]}"
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

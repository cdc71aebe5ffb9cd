#!/usr/bin/env bash
# Record the Unified Buffer / L1 / L0C plans of bishengir-compile for every tile the launchers
# choose, into tests/data/ascend_memory_plans.json: the evidence that devices.py's memory model is an
# upper bound of the compiler's plans (tests/test_ascend_backend.py checks the model against it).
# Run it again after changing the model, the tile choice or a kernel: the test says when the recorded
# tiles are no longer the ones devices.tile picks. (docs/notes/ascend-backend.md, "The memory model")
# The same runs record each configuration's per-row pipeline census (not those with a tile set by
# hand) into tests/data/ascend_census.json, which tests/test_census.py holds against the census's
# targets and against today's kernel sources (docs/notes/npu-census.md).
#
# Needs the lowering venv with ascendnpu-ir (tools/ascend_lowering_env.sh). About 2500 configurations
# (1838 recorded in the census; 624 with a tile set by hand are plans only): 21-45 minutes on 2
# cores that other jobs share. Only the A2 target is recorded: the A3 targets plan the same (the
# gate compiles both for the table on every CI run).
#
# Usage: tools/ascend_memory_plans.sh [PLANS.json [CENSUS.json]]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ASCEND_VENV:-$ROOT/.venv-ascend}"
OUT="${1:-$ROOT/tests/data/ascend_memory_plans.json}"
CENSUS="${2:-$ROOT/tests/data/ascend_census.json}"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
rm -f "$OUT" "$CENSUS"
lower() {
    echo "ascend_memory_plans: lower $*" >&2
    # exit 1 (a failing configuration) is recorded too, and reported by the test; stop on anything else
    "$VENV/bin/python" -m megablocks_ascend lower --targets Ascend910B4 --plans "$OUT" --census "$CENSUS" "$@" \
        >/dev/null || [[ $? -eq 1 ]]
}
# 1. The gate's table: every kernel, dtype, hidden 1024 / 1000, every constexpr path, and the routing
#    kernels an NPU runs at 64 and 256 experts and top_k 8.
lower
# 2. top_k beyond the table's 1 and 2: the scatter's slot tile (BLOCK_K: 4 for top_k 3 and 4) and
#    the token-major gather's unrolled slots grow with it.
lower --only _scatter --axis TOP_K=3,4,8 --axis INT64=false
lower --only _scatter --axis TOP_K=4,8 --axis INT64=false --axis hidden=16,64,100,256 --axis dtype=bf16,fp32
lower --only _gather --axis TOP_K=4,8 --axis INT64=false
lower --only _wgrad --axis TOP_K=4,8 --axis INT64=false --axis dtype=bf16,fp32
# 3. More experts (BLOCK_E 64 and 256) for the kernels of CUDA's form, whose walks' per-expert vectors
#    grow with them (the table itself holds the kernels an NPU runs at 64 and 256 experts).
for e in 64 256; do
    fewer=(--experts "$e" --axis INT64=false --axis dtype=bf16,fp32)
    lower --only _gather_tokens "${fewer[@]}" --axis TOP_K=1,2 --axis SCALE=true
    lower --only _scatter_one "${fewer[@]}" --axis SCALE=true
    lower --only _wgrad_one "${fewer[@]}"
done
# 4. Narrow feature tiles, many rows: hidden sizes below one 512-wide tile, even and uneven.
lower --only _ --axis hidden=16,20,64,100,128,200,256 --axis INT64=false --axis LAYOUT=1 --axis TOP_K=1,2 \
    --axis dtype=bf16,fp32
# 5. How the plan grows with the rows: BLOCK_M 1-16 set by hand at 512 columns (entries "set by
#    hand": the model must bound them too; tools/fit_ub_model.py fits the coefficients on all).
for bm in 1 2 4 8 16; do
    lower --only _scatter --axis TOP_K=1,2,4,8 --axis INT64=false --axis dtype=bf16,fp32 --axis LAYOUT=1 --set BLOCK_M=$bm
    lower --only _gather_tokens --axis TOP_K=1,2,4,8 --axis INT64=false --axis dtype=bf16,fp32 --axis LAYOUT=1 \
        --set BLOCK_M=$bm
    lower --only _scatter_one --axis INT64=false --axis dtype=bf16,fp32 --axis LAYOUT=1 --axis SCALE=true \
        --set BLOCK_M=$bm
    lower --only _gather --axis TOP_K=2 --axis INT64=false --axis dtype=bf16,fp32 --axis LAYOUT=1 --axis MAPPED=true \
        --set BLOCK_M=$bm  # (and _gather_tokens)
    lower --only _wgrad --axis TOP_K=2 --axis INT64=false --axis dtype=bf16,fp32 --axis LAYOUT=1 --experts 64 \
        --set BLOCK_M=$bm
done
# 6. The scatter as MEGABLOCKS_ASCEND_STORES=scattered runs it on an NPU (a load per slot: FLAT=0, set by
#    hand): the scatter's model bounds both forms.
lower --only _scatter --axis TOP_K=1,2,4,8 --axis INT64=false --axis dtype=bf16,fp32 --set FLAT=false
lower --only _scatter --axis TOP_K=1,2,4,8 --axis INT64=false --axis dtype=bf16,fp32 --axis hidden=16,64,100,256 \
    --set FLAT=false
# 7. The routing preparation at 128 and 1024 experts (its item blocks shrink as the keys grow).
for e in 128 1024; do
    lower --only _count --experts "$e"
    lower --only _place --experts "$e" --axis index=i64
done
echo "ascend_memory_plans: wrote $OUT and $CENSUS" >&2

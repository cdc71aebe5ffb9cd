"""An estimate of each kernel's time per row on an Ascend 910B, from the compile gate's census.

    python tools/census_estimate.py [tests/data/ascend_census.json ...] [--config SUBSTRING]

**An estimate, not a measurement**: nothing here ran on an NPU. The census (the gate's count of what
the compiler scheduled per row of a kernel's hot loop: megablocks_ascend/lowering/census.py)
is turned into cycles with the per-operation costs below, which are assumptions (Huawei publishes
no cycle counts for these operations; each is given as a low and a high value), and set beside the
row's bandwidth floor: its DMA bytes at one vector core's share of the HBM bandwidth. The model is
serial (no overlap of the pipes counted), so it errs high where the pipes overlap, which
double-buffering is for; the floor assumes perfect overlap. docs/notes/npu-census.md has the table
and what it can and cannot say.
"""

from __future__ import annotations

import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Assumptions (cycles of a 910B vector core), low and high.
CLOCK_GHZ = 1.8  # the AI core clock of an Atlas 800T A2 (910B) as published for the part
HBM_GBS = 1600.0  # 910B HBM bandwidth (public product figure), shared by...
VECTOR_CORES = 40  # ...the vector cores of an Ascend910B4 (the module's VECTOR_CORE_COUNT)
COSTS = {  # name: (low, high), what each census figure costs
    "flag_pair": (40, 200),  # a set_flag/wait_flag round trip between two pipes (both wait)
    "mte3_barrier": (200, 1000),  # a store DMA that must complete before the next is issued
    "barrier": (10, 50),  # any other pipe_barrier (V, ALL...)
    "vector_op": (20, 60),  # a vector instruction's fixed cost, before its lanes
    "scalar": (2, 10),  # a scalar load or store on the Unified Buffer or global memory
    "dma": (50, 200),  # a DMA's issue cost, before its bytes
}
VECTOR_BYTES_PER_CYCLE = 256  # one repeat of a vector instruction: 256 bytes


def estimate(f: dict) -> dict:
    """Cycles per row (low, high) from a census's figures, and the bandwidth floor."""
    flag_pairs = f["flags"] / 2
    other_barriers = f["barriers"] - f["barriers_mte3"]
    counts = dict(flag_pair=flag_pairs, mte3_barrier=f["barriers_mte3"], barrier=other_barriers,
                  vector_op=f["vector_ops"], scalar=f["scalar_ub"] + f["scalar_gm"], dma=f["dma"])
    low = sum(COSTS[k][0] * v for k, v in counts.items())
    high = sum(COSTS[k][1] * v for k, v in counts.items())
    floor = f["dma_bytes"] / (HBM_GBS / VECTOR_CORES / CLOCK_GHZ)  # bytes / (bytes per cycle per core)
    return dict(low=low, high=high, floor=floor)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", default=[str(ROOT / "tests/data/ascend_census.json")])
    ap.add_argument("--config", default="bf16 H=1024", help="configurations whose label contains this")
    args = ap.parse_args()
    print("| kernel | configuration | NPU runs it | set/wait | MTE3 bar. | vector | scalar | DMA B | "
          "est. cycles (low-high) | floor cycles | x floor (low-high) |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in args.files:
        for e in json.loads(pathlib.Path(path).read_text())["census"]:
            if args.config not in e["config"]:
                continue
            f, est = e["figures"], estimate(e["figures"])
            ratio = (f"{est['low'] / est['floor']:.1f}-{est['high'] / est['floor']:.1f}"
                     if est["floor"] else "-")
            print(f"| {e['kernel']} | {e['config']} | {'yes' if e['npu_chosen'] else 'no'} | {f['flags']:g} | "
                  f"{f['barriers_mte3']:g} | {f['vector_ops']:g} | {f['scalar_ub'] + f['scalar_gm']:g} | "
                  f"{f['dma_bytes']:g} | {est['low']:.0f}-{est['high']:.0f} | {est['floor']:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Fit the Unified Buffer model's coefficients (``devices.UB_MODELS``) to recorded compiler plans.

    python tools/fit_ub_model.py [tests/data/ascend_memory_plans.json]

For each kernel kind, the least non-negative coefficients (summed over the plans) under which
``devices.ub_bytes`` is at or above every recorded plan of the kind's kernels: a linear program,
solved with scipy (not a dependency of the package: run this in any environment that has scipy
and torch). Prints the ``UB_MODELS`` entries, rounded up, and how tight they are. The model's form
is in ``devices.py``'s docstring; the plans come from ``tools/ascend_memory_plans.sh``; what holds
the model in CI is ``tests/test_ascend_backend.py``, not this fit (docs/notes/ascend-backend.md).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import numpy as np
from scipy.optimize import linprog

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megablocks_ascend import devices  # noqa: E402
from megablocks_ascend.lowering import table  # noqa: E402
from megablocks_ascend.lowering.configs import tile_args  # noqa: E402

FIELDS = ("dtype_copies", "f32_copies", "masks", "dtype_copies_k", "f32_copies_k", "per_row",
          "per_row_expert", "per_column", "fixed")
STEPS = (1 / 16, 1 / 16, 1 / 16, 1 / 16, 1 / 16, 16, 1 / 8, 1 / 8, 1024)  # rounding up, per field


def features(entry: dict, spec) -> list[float]:
    """The terms of ``devices.ub_bytes`` per unit coefficient, for one recorded plan."""
    c, axes = entry["constexprs"], entry["axes"]
    bm, bx, es = c["BLOCK_M"], c["BLOCK_X"], table.DTYPES[axes["dtype"]][2]
    args = tile_args(spec, axes, entry["experts"])
    k, be = args["top_k"], devices.block_e(args["num_experts"])
    t = devices.UB_BUFFERS * bm * bx
    return [t * es, t * 4, 0 if c["EVEN_X"] else t, t * es * (k - 1), t * 4 * (k - 1),
            devices.UB_BUFFERS * bm, devices.UB_BUFFERS * bm * 4 * be, devices.UB_BUFFERS * bx * 4 * k, 1]


def main(path: str) -> int:
    plans = json.loads(pathlib.Path(path).read_text())["plans"]
    specs = {s.name: s for s in table.ROUTING_KERNELS if s.kind is not None}
    kinds = sorted({s.kind for s in specs.values()})
    for kind in kinds:
        rows = [e for e in plans if e["kernel"] in specs and specs[e["kernel"]].kind == kind]
        if not rows:  # a file of some kinds' plans (a refit of one kind)
            continue
        a = np.array([features(e, specs[e["kernel"]]) for e in rows], float)
        b = np.array([e["peak"]["ub"] for e in rows], float)
        res = linprog(a.sum(0), A_ub=-a, b_ub=-b, bounds=[(0, None)] * a.shape[1], method="highs")
        if res.status != 0:
            print(f"{kind}: no solution ({res.message})")
            return 1
        x = [math.ceil(v / s - 1e-9) * s for v, s in zip(res.x, STEPS)]
        model = a @ np.array(x)
        coef = ", ".join(f"{f}={v:g}" for f, v in zip(FIELDS, x))
        print(f'"{kind}": UbModel({coef}),  # {len(rows)} plans; least headroom {int((model - b).min())} '
              f"bytes, model / plan {float((model / b).mean()):.2f} on average")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "tests" / "data" / "ascend_memory_plans.json")))

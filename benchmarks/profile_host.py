"""Where the host time of an eager MegaBlocks training step goes, per routing backend (cProfile).

The command line of :mod:`megablocks_ascend.bench.host_profile`: ``--steps`` eager forward+backward
steps of one layer (``--config``: one of ``bench_steps.py``'s configs) profiled for each backend,
the host time per step and the functions with the most own time, per backend.

    python benchmarks/profile_host.py --config qw128 --out DIR      # a GPU or an NPU
    python benchmarks/profile_host.py --quick --out DIR             # CPU smoke test (tiny layer)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton)
from megablocks_ascend.bench import host_profile, report, routing_ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qw128", choices=sorted(host_profile.CONFIGS))
    ap.add_argument("--layer", default="dMoE", choices=("dMoE", "MoE"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--quick", action="store_true", help="tiny layer on the CPU (smoke test)")
    ap.add_argument("--device", default=None, help=routing_ops.DEVICE_HELP + "; --quick: the CPU")
    ap.add_argument("--out", default=report.default_out(), help="directory of the results (default: $OUT if set, else ./bench-results, which git ignores)")
    ap.add_argument("--name", default="profile_host")
    a = ap.parse_args(argv)
    if a.quick:
        a.config, a.tokens, a.steps, a.top = "tiny", 16, 2, 10
    device = routing_ops.setup(a.device or ("cpu" if a.quick else None))
    results, lines = host_profile.profile_backends(a.config, a.layer, device, tokens=a.tokens, n_steps=a.steps,
                                                   top=a.top)
    env = dict(report.environment(device), config=a.config, layer=a.layer, tokens=a.tokens, steps=a.steps)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write_json(out_dir / f"{a.name}.json", dict(environment=env, results=results))
    (out_dir / f"{a.name}.log").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Cost of the value checks behind MEGABLOCKS_ASCEND_CHECKS=1 (one device-to-host sync per call).

Times each routing kernel function through the dispatcher with the checks off and on, at a
mixtral-like routing (T tokens, E experts, top_k), and prints the added time per call. The
command line of :mod:`megablocks_ascend.bench.value_checks`.

    python benchmarks/bench_checks.py [--device cuda|npu] [--backend ascend] [--json out.json]
"""

from __future__ import annotations

import argparse

import megablocks_ascend  # noqa: F401  (before megablocks and triton: the stand-ins, the interpreter on a CPU)
from megablocks_ascend.bench import report, routing_ops, value_checks


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or npu[:N] (default: cpu)")
    p.add_argument("--backend", default="torch")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", default=None, help="write the environment and the rows to this file")
    a = p.parse_args(argv)
    device = routing_ops.setup(a.device)
    rows = value_checks.measure(device, a.backend, tokens=a.tokens, hidden=a.hidden, experts=a.experts,
                                top_k=a.top_k, repeat=a.repeat)
    print(value_checks.table(rows))
    if a.json:
        report.write_json(a.json, dict(environment=report.environment(device), results=rows))


if __name__ == "__main__":
    main()

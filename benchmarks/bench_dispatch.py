"""Host time per routing call, ours against upstream's, level by level (op, dispatcher, launcher):
the command line of :mod:`megablocks_ascend.bench.dispatch`, whose docstring says what each level is.

    python benchmarks/bench_dispatch.py           # a GPU: real launches; a CPU: launches stubbed
    python benchmarks/bench_dispatch.py --stub    # the Python above Triton's launcher only
    python benchmarks/bench_dispatch.py --quick   # fewer calls (CI smoke test)
"""

import sys

from megablocks_ascend.bench.dispatch import main

if __name__ == "__main__":
    sys.exit(main())

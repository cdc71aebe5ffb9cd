"""A/B probe of the routing kernels on one GPU, in one run: the command line of
:mod:`megablocks_ascend.bench.routing_ab`, whose docstring says what each section measures.

    python benchmarks/ab_routing.py --baseline REV --patterns --k1 --out DIR --name ab
    python benchmarks/ab_routing.py --quick --baseline HEAD --patterns --host   # CPU smoke test
"""

import sys

from megablocks_ascend.bench.routing_ab import main

if __name__ == "__main__":
    sys.exit(main())

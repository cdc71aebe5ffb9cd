"""The ``torch`` backend: plain PyTorch implementations of every kernel family the plugin serves.

* :mod:`.routing`: MegaBlocks' routing kernels (``megablocks.backend.kernels``);
* :mod:`.blocksparse`: stk's block-sparse matmuls (``stk.backend.triton_kernels``).

The routing names are re-exported here, so ``from megablocks_ascend import reference;
reference.gather(...)`` keeps working.
"""

from megablocks_ascend.reference import blocksparse, routing  # noqa: F401
from megablocks_ascend.reference.routing import (  # noqa: F401
    binned_gather,
    binned_scatter,
    binned_scatter_wgrad,
    gather,
    padded_gather,
    padded_scatter,
    padded_scatter_wgrad,
    prepare_routing,
    scatter,
    scatter_wgrad,
    slot_rows,
)

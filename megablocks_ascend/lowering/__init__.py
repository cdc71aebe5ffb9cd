"""The Ascend compile gate, on CPU: every kernel configuration through triton-ascend 3.2.0's front
end and Huawei's back-end compiler ``bishengir-compile`` to the ``hivmc`` handoff, its IR counted
and its on-chip memory plan read and checked.

``python -m megablocks_ascend lower`` (in the lowering venv made by ``tools/ascend_lowering_env.sh``;
the command line is :mod:`megablocks_ascend.cli.lower`) runs it over the kernels of
:mod:`megablocks_ascend.kernels` (``routing_kernels``, ``preparation``, ``grouped``, ``topology``:
vector kernels; ``blocksparse``: cube kernels, ``tl.dot``). What that leaves to a real NPU:
``docs/notes/ascend-lowering.md`` and ``docs/notes/ascend-backend.md``.

A tool beside the package's layers, as the benchmark harness (:mod:`megablocks_ascend.bench`) is:
it reads :mod:`megablocks_ascend.kernels`, :mod:`megablocks_ascend.devices` and
:mod:`megablocks_ascend.compat`, and nothing in the layers imports it.

The modules, in the order a configuration meets them:

``table``      the kernels gated, their axes and the representative problem behind their scalars
``configs``    the table expanded into configurations, tiles derived as an NPU's launchers do, and
               ``devices``' memory model of each tile
``driver``     triton-ascend: its front end on one configuration, its npubin stage's flags
``ir``         the front end's Ascend IR read for the kernel's memory pattern (pure functions)
``bishengir``  the back-end stage: the compiler found, run per target, its output classified
``plan``       the planned module read for its memory plan
``gate``       every configuration through both stages, judged, one row each; the readings of the
               planned module and where each is folded into a row (``gate.READINGS``)
``report``     the report, the JSON and the recorded plans
``command``    the ``lower`` subcommand's arguments and exit status

A new kernel is one entry of the table (``table.KERNELS``); ``tests/test_lowering.py`` holds the
table against the kernels' signatures and the launchers' calls. Nothing is imported here: import
the module you need (the package imports no triton; ``driver`` does when a :class:`.driver.Lowerer` is made).
"""

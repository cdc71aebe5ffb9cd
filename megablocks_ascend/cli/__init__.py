"""The package's command-line tools, run as ``python -m megablocks_ascend SUBCOMMAND``.

``doctor``    what this machine will run and how to fix what is missing (:mod:`.doctor`);
``selftest``  every routing kernel against the torch backend on this machine's device, with the precision
              verdict (:mod:`.selftest`);
``bench``     ours against every alternative this device has, timed, with the precision verdict
              (:mod:`.bench`, over :mod:`megablocks_ascend.bench`);
``lower``     the Ascend compile gate: every kernel configuration through triton-ascend's front end
              and the back-end compiler ``bishengir-compile``, with its on-chip memory plan read and
              checked (:mod:`.lower`, over :mod:`megablocks_ascend.lowering`).

Nothing in the runtime package imports from here.
"""

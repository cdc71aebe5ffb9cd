"""``python -m megablocks_ascend SUBCOMMAND``: the package's command-line tools.

Each subcommand is one entry of :data:`SUBCOMMANDS`: its help line, a function that adds its
arguments to an argparse parser, and a function that runs it and returns the exit status.
Add a subcommand (``doctor``, ``selftest``...) by adding an entry; import heavy modules inside
its functions so that ``--help`` and the other subcommands stay cheap.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NamedTuple


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    module: str | None = None  # the module that implements it, where one does


def _module_command(module: str, help: str) -> Subcommand:
    """A subcommand whose module has ``add_arguments(parser)`` and ``main(args) -> int``."""
    import importlib  # noqa: PLC0415

    return Subcommand(help,
                      lambda parser: importlib.import_module(module).add_arguments(parser),
                      lambda args: importlib.import_module(module).main(args),
                      module)


SUBCOMMANDS: dict[str, Subcommand] = {
    "doctor": _module_command(
        "megablocks_ascend.cli.doctor",
        "print what this machine will run (backend per device, versions, patches) and how to fix "
        "what is missing"),
    "selftest": _module_command(
        "megablocks_ascend.cli.selftest",
        "compare every routing kernel with the torch backend on this machine's device (run this "
        "first on an NPU)"),
    "bench": _module_command(
        "megablocks_ascend.cli.bench",
        "time our routing kernels and MoE/dMoE steps against every alternative this device has (the torch "
        "backend; upstream's kernels on CUDA; torch_npu's fused MoE ops on an NPU), with the precision verdict "
        "(run it after selftest)"),
    "lower": _module_command(
        "megablocks_ascend.cli.lower",
        "lower every routing kernel with triton-ascend's front end (needs the lowering venv: "
        "tools/ascend_lowering_env.sh)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megablocks_ascend")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"] and not hasattr(sys.modules["megablocks_ascend"], "installed"):
        # The activation failed (megablocks_ascend/__init__ recorded why): the other subcommands'
        # modules import torch, which may be what fails; doctor reports without it.
        from megablocks_ascend.cli import doctor  # noqa: PLC0415
        return doctor.main(argparse.Namespace(argv=argv))
    args = build_parser().parse_args(argv)
    args.argv = argv  # lets a subcommand start itself again in a fresh process
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())

"""``python -m megablocks_ascend lower``: the compile gate as a subcommand (:func:`add_arguments`,
:func:`main`), in the lowering venv of ``tools/ascend_lowering_env.sh``.

Exit status: 0 when every configuration passed, 1 when one failed (or none ran), 2 when the gate
could not start (bad arguments, no triton-ascend, no back-end compiler, a triton-ascend whose
npubin stage is not the one the gate is written against).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from megablocks_ascend.lowering import bishengir, gate, report
from megablocks_ascend.lowering.configs import configs
from megablocks_ascend.lowering.driver import (
    TARGET_ARCH,
    InterpreterOn,
    Lowerer,
    TritonAscendMissing,
    make_backend,
)
from megablocks_ascend.lowering.table import EXPERTS, KERNELS, MANY_EXPERTS, source_digest

REEXEC_VAR = "_MEGABLOCKS_ASCEND_LOWER_REEXEC"  # set in the process main() starts again


def _parse_values(text: str):
    out = []
    for v in text.split(","):
        v = v.strip()
        if v.lower() in ("true", "false"):
            out.append(v.lower() == "true")
        else:
            try:
                out.append(int(v))
            except ValueError:
                out.append(v)
    return out


def _pairs(items, what: str, single: bool) -> dict:
    out = {}
    for item in items or ():
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"{what} {item!r}: expected NAME=VALUE{'' if single else '[,VALUE...]'}")
        vals = _parse_values(values)
        if single and len(vals) != 1:
            raise ValueError(f"{what} {item!r}: one value")
        out[name] = vals[0] if single else tuple(vals)
    return out


def _with_variants(specs, items) -> tuple:
    """``specs`` with the kernels ``--variant NAME=MODULE`` names taken from ``MODULE`` (a dotted
    module path holding a kernel of the same name): a candidate kernel, or an old form of one, is
    lowered, compiled and held to the same table entry, memory model and census targets."""
    variants = _pairs(items, "--variant", single=True)
    names = {s.name for s in specs}
    unknown = sorted(set(variants) - names)
    if unknown:
        raise ValueError(f"--variant {', '.join(unknown)}: no kernel of that name in the table")
    for name, module in variants.items():
        if not isinstance(module, str) or "." not in module:
            raise ValueError(f"--variant {name}={module!r}: expected a dotted module path")
    return tuple(dataclasses.replace(s, variant=variants[s.name]) if s.name in variants else s for s in specs)


def main(args) -> int:
    """The ``lower`` subcommand (see :func:`add_arguments`)."""
    try:
        axes = _pairs(getattr(args, "axis", None), "--axis", single=False)
        overrides = _pairs(getattr(args, "set", None), "--set", single=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        specs = _with_variants(KERNELS, getattr(args, "variant", None))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    chosen = [s for s in specs if not args.only or args.only in s.name]
    unknown = [f"--axis {n}" for n in axes if not any(n in s.axes for s in chosen)]
    unknown += [f"--set {n}" for n in overrides if not any(n in s.derived or n in s.axes for s in chosen)]
    if unknown:
        print(f"error: {', '.join(unknown)}: no kernel{' matching --only ' + args.only if args.only else ''} "
              f"has it", file=sys.stderr)
        return 2
    try:
        lowerer = Lowerer(args.arch)
    except TritonAscendMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except InterpreterOn as exc:
        if os.environ.get(REEXEC_VAR) or not getattr(args, "argv", None):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        # Something imported triton in interpreter mode first (megablocks_ascend/__init__ does on a
        # machine without devices): start again in a process where TRITON_INTERPRET=0 from the outset.
        import subprocess  # noqa: PLC0415
        env = dict(os.environ, TRITON_INTERPRET="0", **{REEXEC_VAR: "1"})
        return subprocess.call([sys.executable, "-m", "megablocks_ascend", *args.argv], env=env)
    header, backend = [], None
    if getattr(args, "front_end_only", False):
        header.append("back end: not run (--front-end-only): triton-ascend's ttir and ttadapter stages only")
    else:
        try:
            backend = make_backend(lowerer, getattr(args, "targets", None) or bishengir.GATED_TARGETS,
                                   getattr(args, "jobs", None), gate.readers())
        except (bishengir.CompilerMissing, bishengir.StageMismatch) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        header += backend.describe()
    variants = [f"{s.name} from {s.variant}" for s in specs if s.variant]
    if variants:
        header.append(f"variants (--variant): {', '.join(variants)}")
    try:
        cfgs = configs(specs, axes=axes, experts=getattr(args, "experts", None), overrides=overrides)
    except (KeyError, ValueError) as exc:
        print(f"error: --axis/--set: {exc!r}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = gate.run(specs, dump=args.dump, lowerer=lowerer, only=args.only, backend=backend, cfgs=cfgs)
    wall = time.perf_counter() - t0
    front = sum(r["seconds"] for r in results)
    back = sum(res["seconds"] for r in results for res in (r.get("backend") or {}).values())
    timing = (f"time: {wall:.0f} s for {len(results)} configurations (front end {front:.0f} s in one "
              f"process" + (f"; back end {back:.0f} s of compiler runs over {backend.jobs} jobs)" if backend
                            else ")"))
    print(report.format_table(results, header=header + [""] if header else None, footer=["", timing]))
    if args.json:
        report.write_json(args.json, results, backend, args.arch, wall)
    if getattr(args, "plans", None):
        report.write_plans(args.plans, results, backend)
    if getattr(args, "census", None):
        report.write_census(args.census, results, backend,
                            {s.name: source_digest(s) for s in specs if any(r["kernel"] == s.name for r in results)})
    failed = [r for r in results if r["status"] != "ok"]
    seen = set()  # full error text, once per distinct error, on stderr
    for r in failed:
        if r.get("error") and r["error"] not in seen:
            seen.add(r["error"])
            print(f"\n--- {r['kernel']} [{r['config']}]\n{r['error']}", file=sys.stderr)
    return 1 if failed or not results else 0


def add_arguments(parser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--dump", metavar="DIR", help="write each configuration's TTIR and Ascend IR, and "
                        "the back end's input, temporaries (the planned module) and log per target")
    parser.add_argument("--only", metavar="NAME", help="only kernels whose name contains NAME")
    parser.add_argument("--arch", default=TARGET_ARCH, help=f"front-end target (default {TARGET_ARCH})")
    parser.add_argument("--targets", nargs="+", metavar="TARGET",
                        help=f"bishengir-compile --target values to gate (default: {' '.join(bishengir.GATED_TARGETS)})")
    parser.add_argument("--jobs", type=int, metavar="N", help="back-end compiler runs at once (default: the cores)")
    parser.add_argument("--front-end-only", action="store_true",
                        help="stop after triton-ascend's ttadapter stage (no bishengir-compile)")
    parser.add_argument("--axis", action="append", metavar="NAME=V[,V...]",
                        help="replace an axis's values in every kernel that has it (e.g. hidden=64,100 TOP_K=8)")
    parser.add_argument("--experts", type=int, metavar="N",
                        help=f"the problem's expert count (default: the table, {EXPERTS} experts and, for the "
                             f"routing kernels, a few configurations at {', '.join(map(str, MANY_EXPERTS))})")
    parser.add_argument("--set", action="append", metavar="NAME=V",
                        help="set a constexpr by hand after the launchers' choice (e.g. BLOCK_M=64): shows "
                             "what the back end does with a tile no launcher picks")
    parser.add_argument("--plans", metavar="PATH", help="merge the planned peaks into this JSON file")
    parser.add_argument("--census", metavar="PATH", help="merge the census (per row of the hot loop) into this "
                        "JSON file")
    parser.add_argument("--variant", action="append", metavar="NAME=MODULE",
                        help="take kernel NAME from MODULE (a dotted module path, e.g. tests.census_variants): "
                             "gate a variant of a kernel against the same table entry and targets")

"""Run stk's own shipped tests with megablocks-ascend serving stk's kernels, and check, on a GPU,
the conditions under which the ``cuda`` backend refuses stk's own kernels.

stk 0.7.1 ships its unit tests inside the package (``stk/ops/linear_ops_test.py``: 336 cases of
``stk.ops.sdd``/``dsd``/``dds`` forward and backward, every transpose, fp16 and bf16, sizes up to
2048, against ``torch.mm``; absl-py's ``parameterized``; tensors put on ``cuda`` by the tests
themselves). This script loads that module and runs it under ``use_backend(--backend)`` and
``megablocks_ascend.trace()``. It fails unless every test passes, every block-sparse call was
served by the requested backend, each of ``sdd``, ``dsd`` and ``dds`` was called, and (for
``ascend`` and ``torch``) stk's own kernel functions were never called: they are wrapped with
counters for the run.

``--boundary`` checks ``backends.stk_kernels_refusal`` (derivation: ``patches/stk-kernels.md``)
against stk's real kernels: for each kernel and operand layout, one 128-block below and one above
the int16 boundary (32768 elements), it calls stk's own function directly (no dispatch), compares
with the ``torch`` backend, and asks the dispatcher whether it would refuse. Each case must be
"stk right and not refused" or "stk wrong and refused". A wrapped int16 offset points up to 32768
rows or columns *before* an operand, so every dense operand is a view into a buffer with that much
zeroed memory in front of it: stk's wrong reads land there (no illegal access) and show up as a
wrong result. ``ascend`` is checked at the same shapes.

Usage (GPU, ~1-2 min)::

    PYTHONPATH=/tmp/site:$PWD python tools/run_stk_tests.py --boundary --out OUT
    python tools/run_stk_tests.py --quick --out OUT   # CPU smoke test (interpreter, a few cases)

``--quick`` runs the smallest problem of each test, every transpose, fp16 (12 cases; CPU tensors:
the tests' ``torch.device("cuda")`` is redirected to the CPU for the run), and the boundary
section without stk's own kernels (they need a GPU): the refusal decisions, and our kernels in
the interpreter at the same shapes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import platform
import sys
import time
import types
import unittest
from collections import Counter
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before stk and triton: patches, interpreter on CPU)
from megablocks_ascend.bench.report import default_out  # noqa: E402
import stk.backend.triton_kernels as stk_kernels
import torch

from megablocks_ascend import backends

NAMES = ("sdd", "dsd", "dds", "row_indices")
LIMIT = 1 << 15


# ---------------------------------------------------------------------------------------------
# stk's shipped tests.


@contextlib.contextmanager
def counting_stk_kernels():
    """Count every call of stk's own kernel functions (what the ``cuda`` backend runs)."""
    counts = Counter()
    saved = {name: backends._upstream_stk(name) for name in NAMES}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return counted

    backends.UPSTREAM_STK.update({name: wrap(name, fn) for name, fn in saved.items()})
    try:
        yield counts
    finally:
        backends.UPSTREAM_STK.update(saved)


class _CpuTorch(types.ModuleType):
    """``torch`` as the stk test module sees it in --quick: ``torch.device("cuda")`` is the CPU."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        if name == "device":
            return lambda *a, **k: torch.device("cpu")
        return getattr(torch, name)


def run_stk_tests(backend: str, quick: bool) -> dict:
    module = importlib.import_module("stk.ops.linear_ops_test")
    if quick:
        module.torch = _CpuTorch()
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    tests = list(_flatten(suite))
    if quick:  # cases 0-7: the smallest problem (128, 128, 128, dense), each transpose; even: fp16
        tests = [t for t in tests if _case_index(t) in (0, 2, 4, 6)]
    result = unittest.TestResult()
    start = time.time()
    with counting_stk_kernels() as stk_calls, megablocks_ascend.use_backend(backend), \
            megablocks_ascend.trace() as calls:
        unittest.TestSuite(tests).run(result)
    served = Counter((c.op, c.backend) for c in calls)
    failures = [(str(t), tb.splitlines()[-1]) for t, tb in result.failures + result.errors]
    ops = {op for op, _ in served}
    ok = (result.testsRun > 0 and not failures and {b for _, b in served} == {backend}
          and {"sdd", "dsd", "dds"} <= ops and (backend == "cuda" or sum(stk_calls.values()) == 0))
    if quick:
        module.torch = torch
    return dict(backend=backend, tests=result.testsRun, failures=failures[:20], failed=len(failures),
                served={f"{op} by {b}": n for (op, b), n in sorted(served.items())},
                stk_own_calls=dict(stk_calls), seconds=round(time.time() - start, 1), ok=ok)


def _flatten(suite):
    for t in suite:
        if isinstance(t, unittest.TestSuite):
            yield from _flatten(t)
        else:
            yield t


def _case_index(test):
    """absl names the cases of a parameterized class ``<method><index>`` in the order of
    ``linear_ops_test._LINEAR_OP_TESTS`` (sizes x transposes x dtypes)."""
    name = test._testMethodName
    digits = len(name) - len(name.rstrip("0123456789"))
    return int(name[-digits:]) if digits else -1


# ---------------------------------------------------------------------------------------------
# The refusal boundary.


def _guarded(rows, cols, dtype, device, gen, guard):
    """A [rows, cols] tensor of random values with ``guard`` zero elements in front of it."""
    buf = torch.zeros(guard + rows * cols, dtype=dtype, device=device)
    buf[guard:] = (torch.randn(rows * cols, generator=gen) * 0.1).to(dtype).to(device)
    return buf[guard:].view(rows, cols)


def _topology(shape, block, blocks, device):
    from stk.matrix import Matrix  # noqa: PLC0415
    rows = torch.tensor([r for r, _ in blocks], dtype=torch.int16)
    cols = torch.tensor([c for _, c in blocks], dtype=torch.int16)
    offsets = torch.zeros(shape[0] // block + 1, dtype=torch.int32)
    for r, _ in blocks:
        offsets[r + 1:] += 1
    data = torch.empty(len(blocks), block, block)
    m = Matrix(shape, data, rows, cols, offsets)
    return {k: getattr(m, k).to(device) for k in ("row_indices", "column_indices", "offsets", "offsets_t",
                                                 "column_indices_t", "block_offsets_t")}


def boundary_cases(device, dtype, guarded=True, block=128, inner=128):
    """(name, size, op, arguments without ``out``, output shape) at and past each int16 boundary."""
    gen = torch.Generator().manual_seed(0)
    # the farthest a wrapped offset reaches before an operand (none needed where stk does not run)
    guard = LIMIT * inner + LIMIT * block if guarded else 0
    cases = []
    for size in (LIMIT, LIMIT + block):
        last = size // block - 1
        t = _topology((size, 2 * block), block, [(last, 0), (last, 1)], device)
        cases.append(("sdd rows", size, "sdd", dict(
            lhs=_guarded(size, inner, dtype, device, gen, guard), rhs=_guarded(inner, 2 * block, dtype, device, gen, 0),
            shape=(size, 2 * block), offsets=t["offsets"], row_indices=t["row_indices"],
            column_indices=t["column_indices"]), (2, block, block)))
        t = _topology((block, size), block, [(0, 0), (0, last)], device)
        cases.append(("sdd columns", size, "sdd", dict(
            lhs=_guarded(block, inner, dtype, device, gen, 0), rhs=_guarded(inner, size, dtype, device, gen, guard),
            shape=(block, size), offsets=t["offsets"], row_indices=t["row_indices"],
            column_indices=t["column_indices"]), (2, block, block)))
        t = _topology((block, size), block, [(0, 0), (0, last)], device)
        data = (torch.randn(2, block, block, generator=gen) * 0.1).to(dtype).to(device)
        for layout in ("rhs.t()", "rhs contiguous"):
            rhs = _guarded(inner, size, dtype, device, gen, guard).t() if layout == "rhs.t()" else \
                _guarded(size, inner, dtype, device, gen, guard)
            cases.append((f"dsd {layout}", size, "dsd", dict(
                shape=(block, size), data=data, **t, transpose_a=False, rhs=rhs), (block, inner)))
        t = _topology((size, block), block, [(0, 0), (last, 0)], device)
        for layout in ("lhs contiguous", "lhs.t()"):
            lhs = _guarded(inner, size, dtype, device, gen, guard) if layout == "lhs contiguous" else \
                _guarded(size, inner, dtype, device, gen, guard).t()
            cases.append((f"dds {layout}", size, "dds", dict(
                lhs=lhs, shape=(size, block), data=data, **t, transpose_b=False), (inner, block)))
    return cases


def _run(op, backend, kwargs, out_shape, dtype, device, direct=None):
    out = torch.full(out_shape, float("nan"), dtype=dtype, device=device)
    if direct is not None:
        direct(**kwargs, out=out)
    else:
        with megablocks_ascend.use_backend(backend):
            getattr(stk_kernels, op)(**kwargs, out=out)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def _right(out, ref, dtype):
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    err = float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
    return bool(torch.isfinite(out).all()) and err < tol, err


def check_boundary(device, quick: bool) -> list[dict]:
    dtype = torch.bfloat16
    rows = []
    run_stk = device.type == "cuda" and not quick
    for name, size, op, kwargs, out_shape in boundary_cases(device, dtype, guarded=run_stk):
        ref = _run(op, "torch", kwargs, out_shape, dtype, device)
        row = dict(case=name, size=size, op=op)
        try:
            why = backends.stk_kernels_refusal(op, {**kwargs, "out": torch.empty(out_shape, dtype=dtype, device="meta")})
        except Exception as e:  # noqa: BLE001
            why = f"error: {e}"
        row["refused"] = why is not None
        if run_stk:
            stk_out = _run(op, None, kwargs, out_shape, dtype, device, direct=backends._upstream_stk(op))
            row["stk_right"], row["stk_err"] = _right(stk_out, ref, dtype)
            row["consistent"] = row["stk_right"] != row["refused"]
        ours = _run(op, "ascend", kwargs, out_shape, dtype, device)
        row["ascend_right"], row["ascend_err"] = _right(ours, ref, dtype)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("ascend", "torch", "cuda"), nargs="+", default=["ascend"],
                   help="who serves stk's kernels while its tests run (default: ascend)")
    p.add_argument("--boundary", action="store_true", help="also check the cuda refusal at each int16 boundary")
    p.add_argument("--quick", action="store_true", help="CPU smoke test: a few cases, interpreter")
    p.add_argument("--out", default=default_out(), help="directory for run_stk_tests.json (default: $OUT if set, else ./bench-results, which git ignores)")
    a = p.parse_args()

    device = torch.device("cpu" if a.quick else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: stk's tests put their tensors on cuda; use --quick on a CPU", file=sys.stderr)
        return 2
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  host=platform.node(), torch=torch.__version__, triton=__import__("triton").__version__,
                  device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                  quick=a.quick, stk_tests=[], boundary=[])
    for backend in a.backend:
        report["stk_tests"].append(run_stk_tests(backend, a.quick))
    if a.boundary:
        report["boundary"] = check_boundary(device, a.quick)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_stk_tests.json").write_text(json.dumps(report, indent=1, default=str))

    ok = all(r["ok"] for r in report["stk_tests"])
    print(f"\nstk's shipped tests (stk/ops/linear_ops_test.py), {report['device']}, torch {report['torch']}, "
          f"triton {report['triton']}")
    print(f"{'backend':8} {'tests':>6} {'failed':>6} {'stk own calls':>13} {'s':>6}  served")
    for r in report["stk_tests"]:
        print(f"{r['backend']:8} {r['tests']:6d} {r['failed']:6d} {sum(r['stk_own_calls'].values()):13d} "
              f"{r['seconds']:6.1f}  {', '.join(f'{k}: {v}' for k, v in r['served'].items())}")
        for name, last in r["failures"][:5]:
            print(f"   FAILED {name}: {last}")
    if report["boundary"]:
        print(f"\nint16 boundary (bf16, 128-blocks; stk's own kernel called directly)")
        print(f"{'case':18} {'size':>6} {'cuda refused':>12} {'stk right':>9} {'consistent':>10} {'ascend right':>12}")
        for r in report["boundary"]:
            print(f"{r['case']:18} {r['size']:6d} {str(r['refused']):>12} {str(r.get('stk_right', '-')):>9} "
                  f"{str(r.get('consistent', '-')):>10} {str(r['ascend_right']):>12}")
            ok &= r["ascend_right"] and r.get("consistent", True)
        expected = {(r["case"], r["size"]): r["size"] > LIMIT and r["case"] in ("sdd rows", "sdd columns")
                    for r in report["boundary"]}
        ok &= all(r["refused"] == expected[(r["case"], r["size"])] for r in report["boundary"])
    print("\nALL OK" if ok else "\nFAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

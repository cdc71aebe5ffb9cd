"""Block-sparse matmul benchmark: our kernels vs stk's own vs a dense cuBLAS matmul of the same FLOPs.

For each shape, builds the sparse dMoE's topology exactly as MegaBlocks 0.10.0 does for a random
routing (``ParallelDroplessMLP.indices_and_padded_bins``, ``.topology`` and ``.sparse_transpose``
called on a stand-in ``self``; block size 128), and runs every kernel call the sparse dMoE's
expert MLP (``SparseMLP``: ``x @ w1^T``, GeLU, ``@ w2``) makes, forward and backward:

=========================  ==========================================================  ======
call                       what                                                        kernel
=========================  ==========================================================  ======
``fwd sdd x@w1t``          ``sdd(x, w1.t(), topo)``: the first layer, on the topology  sdd
``fwd dsd a@w2``           ``dsd(a, w2)``: the second layer                            dsd
``bwd sdd dy@w2t``         the second layer's data gradient (on the topology)          sdd
``bwd dsdT aT@dy (dw2)``   ``dsd(a.t(), dy)``: the second layer's weight gradient      dsd^T
``bwd dsd g@w1 (dx)``      ``dsd(g, w1)``: the first layer's data gradient             dsd
``bwd dsdT gT@x (dw1)``    ``dsd(g.t(), x)``: the first layer's weight gradient        dsd^T
=========================  ==========================================================  ======

(``a``, ``g``: sparse activations and their gradient, ``[nnz, 128, 128]``.) Each call is checked
against a float32 cuBLAS reference computed expert by expert (poisoned outputs: every element must
be written), then timed and compared with

* a dense cuBLAS matmul of the same FLOPs and layouts (``torch.mm``): sdd ``[Tp, H] @ [H, F]``
  (the right operand a transposed view), dsd ``[Tp, F] @ [F, H]``, dsd^T ``[F, Tp]^T-view @ [Tp, H]``;
* stk 0.7.1's own kernels (``stk/backend/triton_kernels.py`` loaded afresh, so whatever serves
  ``stk.backend.triton_kernels`` in this process does not matter), run in child processes: at
  sizes where they overflow int16 arithmetic they read out of bounds, which can kill the CUDA
  context. Where they are wrong or crash, the report says so.

Also: a small config sweep per kernel (tile sides, grouping, warps, stages, programs per SM) at
the two issue shapes; our ``row_indices`` against the one MegaBlocks' topology made; an int64
case (a dsd whose dense operand has more than 2**31 elements).

FLOPs per call: ``2 * nnz * 128 * 128 * H`` (every call multiplies the same blocks with ``H``
columns or rows). Times are :func:`~megablocks_ascend.bench.timing.do_bench`'s (on CUDA
``triton.testing.do_bench``, median of three medians; on an NPU device events; on the CPU one call,
a smoke test). ``benchmarks/bench_blocksparse.py`` is its command line; stk's kernels run in
``python -m megablocks_ascend.bench.blocksparse --stk-child ...`` processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
import types
from pathlib import Path

import megablocks_ascend  # noqa: F401  (before megablocks and triton: stand-ins, interpreter on CPU)
import numpy as np
import torch

from megablocks_ascend import devices
from megablocks_ascend.bench import report, timing
from megablocks_ascend.bench.precision import rel_l2
from megablocks_ascend.kernels import blocksparse



BLOCK = 128
SHAPES = {
    "mixtral": dict(T=8192, H=4096, F=14336, E=8, k=2),
    "fine": dict(T=16384, H=2048, F=1408, E=64, k=6),
    # Block indices below 256, where stk's int16 arithmetic stays in range: stk's sdd is correct
    # here, so its speed can be compared with ours.
    "stk-safe": dict(T=8192, H=4096, F=14336, E=2, k=1),
}
SWEEP_SHAPES = ("mixtral", "fine")
TARGET_SHAPES = ("mixtral", "fine")  # the shapes: the 70%-of-dense target applies there
QUICK_SHAPES = {"quick": dict(T=40, H=128, F=256, E=2, k=2)}  # H: stk wants multiples of 128

CALLS = (
    ("fwd sdd x@w1t", "sdd"),
    ("fwd dsd a@w2", "dsd"),
    ("bwd sdd dy@w2t", "sdd"),
    ("bwd dsdT aT@dy (dw2)", "dsdT"),
    ("bwd dsd g@w1 (dx)", "dsd"),
    ("bwd dsdT gT@x (dw1)", "dsdT"),
)
KINDS = {"sdd": "sdd", "dsd": "dsd", "dsdT": "dsd"}  # call form -> devices.cube_tile kind

T_ = devices.CubeTile
SWEEP = {  # candidate tiles per call form (2-byte operands, block size 128); the first is the default
    # sdd: pairs of blocks as one 128 x 256 tile (devices.CubeTile.pairs), against single blocks
    "sdd": [T_(128, 128, 64, 8, 8, 4, 1, pairs=True), T_(128, 128, 64, 8, 8, 3, 1, pairs=True),
            T_(128, 128, 64, 4, 8, 4, 1, pairs=True), T_(128, 128, 64, 16, 8, 4, 1, pairs=True),
            T_(128, 128, 64, 8, 8, 3, 2), T_(128, 128, 64, 8, 4, 4, 2)],
    # dsd: affine runs computed (devices.CubeTile.affine), against loaded at every K-step
    "dsd": [T_(128, 256, 64, 8, 8, 3, 1, affine=True), T_(128, 256, 64, 8, 8, 4, 1, affine=True),
            T_(128, 256, 128, 8, 8, 2, 1, affine=True), T_(128, 256, 64, 8, 8, 3, 1)],
    "dsdT": [T_(128, 256, 64, 8, 8, 3, 1, affine=True), T_(128, 256, 64, 8, 8, 4, 1, affine=True),
             T_(128, 256, 64, 4, 8, 3, 1, affine=True), T_(128, 256, 128, 8, 8, 2, 1)],
}
QUICK_SWEEP = {"sdd": [T_(128, 128, 128), T_(64, 64, 64, 2)]}
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}  # relative Frobenius error


# ------------------------------------------------------------------------------------------
# The problem: MegaBlocks' topology and the dMoE's operands.


def megablocks_topology(T, E, k, F, H, device, gen):
    """Random routing -> (padded_bins, stk.Matrix topology), by MegaBlocks' own methods."""
    from megablocks.layers.arguments import Arguments  # noqa: PLC0415
    from megablocks.layers.dmoe import ParallelDroplessMLP  # noqa: PLC0415

    args = Arguments(hidden_size=H, ffn_hidden_size=F, moe_num_experts=E, moe_top_k=k, mlp_impl="grouped",
                     bf16=True, fp16=False, device=device)
    me = types.SimpleNamespace(args=args, blocking=BLOCK, ffn_hidden_size=F, num_experts=E, top_k=k,
                               sort_end_bit=max(int(np.ceil(np.log2(E))), 1),
                               transpose_sort_end_bit=max(int(np.ceil(np.log2(E * F // BLOCK))), 1))
    me.sparse_transpose = lambda *a: ParallelDroplessMLP.sparse_transpose(me, *a)
    logits = torch.randn(T, E, device=device, generator=gen)
    top = torch.topk(torch.softmax(logits, dim=-1), k).indices.flatten().int()
    _, _, _, padded_bins, _ = ParallelDroplessMLP.indices_and_padded_bins(me, top)
    tp = int(padded_bins[-1].item())
    # topology() reads only the size and device of its x: a broadcast view stands in for it
    topo = ParallelDroplessMLP.topology(me, torch.empty(1, device=device).expand(tp, H), padded_bins)
    return padded_bins, topo


class Problem:
    def __init__(self, name, T, H, F, E, k, device, dtype, seed=0):
        self.name, self.H, self.F, self.E, self.device, self.dtype = name, H, F, E, device, dtype
        self.seed = seed
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.padded_bins, self.topo = megablocks_topology(T, E, k, F, H, device, self.gen)
        self.Tp = int(self.padded_bins[-1].item())
        self.EF = E * F
        self.nnz = self.topo.row_indices.numel()
        self.bpr = F // BLOCK
        pb = [0] + self.padded_bins.tolist()
        self.segments = [(pb[e], pb[e + 1]) for e in range(E)]  # token rows of each expert
        self._cache = {}

    TENSORS = ("x", "dy", "w1", "w2", "a", "g", "dense_a")

    def rand(self, name, shape, scale=1.0):
        """A named random operand: its own seed, so every process draws the same one in any order."""
        if name not in self._cache:
            gen = torch.Generator(device=self.device).manual_seed(self.seed * 100 + self.TENSORS.index(name))
            t = torch.randn(shape, device=self.device, generator=gen)
            self._cache[name] = (t * scale).to(self.dtype)
        return self._cache[name]

    x = property(lambda s: s.rand("x", (s.Tp, s.H)))
    dy = property(lambda s: s.rand("dy", (s.Tp, s.H)))
    w1 = property(lambda s: s.rand("w1", (s.EF, s.H), s.H ** -0.5))
    w2 = property(lambda s: s.rand("w2", (s.EF, s.H), s.H ** -0.5))
    a = property(lambda s: s.rand("a", (s.nnz, BLOCK, BLOCK)))
    g = property(lambda s: s.rand("g", (s.nnz, BLOCK, BLOCK)))

    @property
    def meta(self):
        t = self.topo
        return (t.offsets, t.row_indices, t.column_indices, t.offsets_t, t.column_indices_t, t.block_offsets_t)

    def flops(self) -> float:
        return 2.0 * self.nnz * BLOCK * BLOCK * self.H

    def operands(self, call):
        """(form, operands) of a call: sdd (lhs, rhs), dsd/dsdT (data, rhs)."""
        return {
            "fwd sdd x@w1t": ("sdd", (self.x, self.w1.t())),
            "fwd dsd a@w2": ("dsd", (self.a, self.w2)),
            "bwd sdd dy@w2t": ("sdd", (self.dy, self.w2.t())),
            "bwd dsdT aT@dy (dw2)": ("dsdT", (self.a, self.dy)),
            "bwd dsd g@w1 (dx)": ("dsd", (self.g, self.w1)),
            "bwd dsdT gT@x (dw1)": ("dsdT", (self.g, self.x)),
        }[call]

    def out(self, form):
        shape = {"sdd": (self.nnz, BLOCK, BLOCK), "dsd": (self.Tp, self.H), "dsdT": (self.EF, self.H)}[form]
        return torch.full(shape, float("nan"), dtype=self.dtype, device=self.device)

    def run(self, impl, form, ops, out, **launch):
        """One call of ``impl`` (a module with stk's four functions) into ``out``."""
        if form == "sdd":
            impl.sdd(ops[0], ops[1], (self.Tp, self.EF), out, self.topo.offsets, self.topo.row_indices,
                     self.topo.column_indices, **launch)
        elif form == "dsd":
            impl.dsd((self.Tp, self.EF), ops[0], *self.meta, False, ops[1], out, **launch)
        else:
            impl.dsd((self.EF, self.Tp), ops[0], *self.meta, True, ops[1], out, **launch)
        return out

    # float32 references, expert by expert (MegaBlocks' topology: each expert's token block rows
    # hold its F / 128 consecutive column blocks, so its blocks are one contiguous run of `data`)
    def _expert_blocks(self, data, e):
        r0, r1 = self.segments[e]
        return data[r0 // BLOCK * self.bpr:r1 // BLOCK * self.bpr].float()

    def _dense_expert(self, data, e):
        r0, r1 = self.segments[e]
        blocks = self._expert_blocks(data, e).view((r1 - r0) // BLOCK, self.bpr, BLOCK, BLOCK)
        return blocks.permute(0, 2, 1, 3).reshape(r1 - r0, self.F)

    def reference(self, form, ops):
        H, F = self.H, self.F
        if form == "sdd":
            lhs, rhs = ops
            out = torch.empty(self.nnz, BLOCK, BLOCK, dtype=torch.float32, device=self.device)
            for e, (r0, r1) in enumerate(self.segments):
                if r1 > r0:
                    prod = lhs[r0:r1].float() @ rhs[:, e * F:(e + 1) * F].float()
                    nb = (r1 - r0) // BLOCK
                    out[r0 // BLOCK * self.bpr:r1 // BLOCK * self.bpr] = \
                        prod.view(nb, BLOCK, self.bpr, BLOCK).permute(0, 2, 1, 3).reshape(-1, BLOCK, BLOCK)
            return out
        data, rhs = ops
        if form == "dsd":
            out = torch.zeros(self.Tp, H, dtype=torch.float32, device=self.device)
            for e, (r0, r1) in enumerate(self.segments):
                if r1 > r0:
                    out[r0:r1] = self._dense_expert(data, e) @ rhs[e * F:(e + 1) * F].float()
            return out
        out = torch.zeros(self.EF, H, dtype=torch.float32, device=self.device)
        for e, (r0, r1) in enumerate(self.segments):
            if r1 > r0:
                out[e * F:(e + 1) * F] = self._dense_expert(data, e).t() @ rhs[r0:r1].float()
        return out

    def grouped_analog(self, form):
        """The same products as a grouped GEMM over the same padded groups (the ``grouped_gemm``
        stand-in: ``torch._grouped_mm`` for bf16 on Hopper), on dense ``[Tp, F]`` activations where
        ours reads stk's ``[nnz, 128, 128]`` blocks: sdd ``x @ w1[e].T``, dsd ``a @ w2[e]``, dsd^T
        ``a.T @ dy`` per expert (the copy between the two layouts not counted)."""
        from megablocks_ascend.native import grouped_gemm  # noqa: PLC0415
        name = f"grouped_{form}"
        if name not in self._cache:
            sizes = torch.diff(self.padded_bins, prepend=self.padded_bins.new_zeros(1)).long()
            a = self.rand("dense_a", (self.Tp, self.F))
            if form == "sdd":
                args = (self.x, self.w1.view(self.E, self.F, self.H), sizes, False, True)
            elif form == "dsd":
                args = (a, self.w2.view(self.E, self.F, self.H), sizes, False, False)
            else:
                args = (a, self.dy, sizes, True, False)
            self._cache[name] = args
        a, b, sizes, trans_a, trans_b = self._cache[name]
        return lambda: grouped_gemm.gmm(a, b, sizes, trans_a=trans_a, trans_b=trans_b)

    def dense_analog(self, form):
        """A dense cuBLAS matmul with the same FLOPs and operand layouts as a call of ``form``."""
        name = f"dense_{form}"
        if name not in self._cache:
            if form == "sdd":  # [Tp, H] @ [H, F] (a transposed view, as w1.t())
                a, b = self.x, self.w1[:self.F].t()
            elif form == "dsd":  # [Tp, F] @ [F, H]
                a, b = self.rand("dense_a", (self.Tp, self.F)), self.w2[:self.F]
            else:  # [F, Tp] (a transposed view) @ [Tp, H]
                a, b = self.rand("dense_a", (self.Tp, self.F)).t(), self.dy
            self._cache[name] = (a, b, torch.empty(a.shape[0], b.shape[1], dtype=self.dtype, device=self.device))
        a, b, out = self._cache[name]
        return lambda: torch.mm(a, b, out=out)


def compare(out, ref) -> dict:
    """``out`` against the float32 reference: relative L2 error, largest difference over the largest
    reference value, and the elements left unwritten (NaN: outputs are poisoned before a call)."""
    nan = int(torch.isnan(out).sum().item())
    mx = (out.float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    return dict(rel_err=rel_l2(out, ref) if nan == 0 else float("inf"), max_err=mx if nan == 0 else float("inf"),
                unwritten=nan)


def checked(r, dtype) -> dict:
    r["ok"] = r["unwritten"] == 0 and r["rel_err"] <= TOL[dtype]
    return r



def tflops(flops, ms):
    return flops / ms / 1e9


# ------------------------------------------------------------------------------------------
# stk's own kernels, in child processes.


def stk_module():
    """stk 0.7.1's ``stk/backend/triton_kernels.py`` as shipped, loaded under its own name."""
    spec = importlib.util.find_spec("stk.backend.triton_kernels")
    mod_spec = importlib.util.spec_from_file_location("_stk_triton_kernels_as_shipped", spec.origin)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod


def stk_int16_overflow(p: Problem, form) -> bool:
    """Whether stk's kernel forms an element offset from an int16 block index times a constexpr
    (which stays int16 on Triton >= 3.2): its sdd does, ``row_index * 128`` and
    ``column_index * 128``; its dsd multiplies its int16 column index by an int32 stride (int32)."""
    if form != "sdd":
        return False
    return max(int(p.topo.row_indices.max()), int(p.topo.column_indices.max())) * BLOCK > 32767


def stk_child(pairs, out_file, quick, dtype_name, device_name):
    """Runs stk's kernels on ``pairs`` of (shape, call), one JSON line per call; exits 3 when the
    device faults (the CUDA context is gone: the parent goes on in a new process)."""
    device = torch.device(device_name)
    dtype = getattr(torch, dtype_name)
    shapes = QUICK_SHAPES if quick else SHAPES
    stk = stk_module()
    p = None
    with open(out_file, "a") as f:
        for shape_name, call in pairs:
            if p is None or p.name != shape_name:
                p = None
                timing.empty_cache(device)
                p = Problem(shape_name, device=device, dtype=dtype, **shapes[shape_name])
            form, ops = p.operands(call)
            out = p.out(form)
            try:
                p.run(stk, form, ops, out)
                timing.synchronize(device)
            except Exception as e:  # noqa: BLE001  (stk refused the call, or the device faulted)
                fault = isinstance(e, RuntimeError) and "CUDA" in str(e)
                f.write(json.dumps(dict(shape=shape_name, call=call, ok=False, refused=not fault, crashed=fault,
                                        error=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}")) + "\n")
                f.flush()
                if fault:
                    sys.exit(3)
                continue
            r = checked(compare(out, p.reference(form, ops)), dtype)
            r.update(shape=shape_name, call=call, ms=timing.do_bench(lambda: p.run(stk, form, ops, out), device))
            f.write(json.dumps(r) + "\n")
            f.flush()
            del out


def stk_runs(pairs, dtype, quick, log, out_dir, device: torch.device = torch.device("cpu")) -> dict:
    """stk's kernels on ``pairs`` of (shape, call) on ``device``, in child processes, a new one after
    each fault, until every pair ran, was refused or faulted: {(shape, call): result}."""
    results, remaining = {}, [tuple(x) for x in pairs]
    partial = Path(out_dir) / "stk_child.jsonl"
    while remaining:
        partial.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", __name__, "--stk-child", json.dumps(remaining), "--stk-out", str(partial),
               "--dtype", str(dtype).split(".")[-1], "--device", str(device)] + (["--quick"] if quick else [])
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
        except subprocess.TimeoutExpired as e:
            proc = subprocess.CompletedProcess(cmd, -9, "", f"timed out after {e.timeout} s")
        done = [json.loads(line) for line in partial.read_text().splitlines()] if partial.exists() else []
        for r in done:
            results[(r["shape"], r["call"])] = r
        remaining = remaining[len(done):]
        if done and done[-1].get("crashed"):
            log(f"  stk {done[-1]['shape']} {done[-1]['call']}: CRASHED ({done[-1]['error'][:160]})")
        elif remaining:  # died without a word: count it against the pair it was running
            tail = [line for line in (proc.stderr or "").strip().splitlines() if line.strip()][-2:]
            shape, call = remaining.pop(0)
            results[(shape, call)] = dict(shape=shape, call=call, ok=False, crashed=True,
                                          error=(" | ".join(tail) or f"exit status {proc.returncode}")[-300:])
            log(f"  stk {shape} {call}: CRASHED ({results[(shape, call)]['error'][:160]})")
    partial.unlink(missing_ok=True)
    return results


# ------------------------------------------------------------------------------------------
# The runs


def run_shape(name, shape, device, dtype, *, sweep, quick, log):
    t0 = time.perf_counter()
    p = Problem(name, device=device, dtype=dtype, **shape)
    log(f"{name}: T={shape['T']} H={p.H} F={p.F} E={p.E} k={shape['k']}: padded tokens {p.Tp}, "
        f"{p.Tp // BLOCK} x {p.EF // BLOCK} blocks, nnz {p.nnz}, {p.flops() / 1e12:.3f} TFLOP per call")
    rows = []
    # our row_indices against the one MegaBlocks' topology made (stk's kernel, or whoever serves it)
    ri = torch.full_like(p.topo.row_indices, -1)
    blocksparse.row_indices(p.topo.size(), p.topo.data, p.topo.offsets, p.topo.column_indices, ri)
    row_ok = bool(torch.equal(ri, p.topo.row_indices))
    dense_ms, gmm_ms = {}, {}
    for call, form in CALLS:
        _, ops = p.operands(call)
        out = p.out(form)
        p.run(blocksparse, form, ops, out)
        timing.synchronize(device)
        r = checked(compare(out, p.reference(form, ops)), dtype)
        r.update(shape=name, call=call, form=form, flops=p.flops())
        r["ms"] = timing.do_bench(lambda: p.run(blocksparse, form, ops, out), device)
        if form not in dense_ms:
            dense_ms[form] = timing.do_bench(p.dense_analog(form), device)
        r["dense_ms"] = dense_ms[form]
        r["tflops"], r["dense_tflops"] = tflops(p.flops(), r["ms"]), tflops(p.flops(), r["dense_ms"])
        r["vs_dense"] = r["dense_ms"] / r["ms"]
        if device.type == "cuda":
            if form not in gmm_ms:
                gmm_ms[form] = timing.do_bench(p.grouped_analog(form), device)
            r["gmm_ms"] = gmm_ms[form]
            r["vs_gmm"] = r["ms"] / r["gmm_ms"]  # <= 1.05: within 5% of the grouped GEMM
        r["stk_int16_overflow_predicted"] = stk_int16_overflow(p, form)
        rows.append(r)
        log(f"  ours {call:22s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TF/s  dense {r['dense_tflops']:7.1f} TF/s "
            f"({r['vs_dense']:.0%})  grouped_mm {r.get('gmm_ms', float('nan')):.3f} ms "
            f"({r.get('vs_gmm', float('nan')):.2f}x)  rel err {r['rel_err']:.1e} {'ok' if r['ok'] else 'WRONG'}")
        del out
    swept = []
    if sweep and (name in SWEEP_SHAPES or quick):
        swept = run_sweep(p, device, dtype, quick, log)
    log(f"  ({time.perf_counter() - t0:.0f} s)")
    return dict(rows=rows, sweep=swept, row_indices_ok=row_ok, padded_tokens=p.Tp, nnz=p.nnz)


def run_sweep(p: Problem, device, dtype, quick, log):
    out = []
    for form, candidates in (QUICK_SWEEP if quick else SWEEP).items():
        call = next(c for c, f in CALLS if f == form)
        _, ops = p.operands(call)
        res = p.out(form)
        ref = None
        for tile in candidates:
            res.fill_(float("nan"))
            try:
                p.run(blocksparse, form, ops, res, tile=tile)
                timing.synchronize(device)
                if ref is None:
                    ref = p.reference(form, ops)
                r = checked(compare(res, ref), dtype)
                r["ms"] = timing.do_bench(lambda: p.run(blocksparse, form, ops, res, tile=tile), device, repeats=1)
                r["tflops"] = tflops(p.flops(), r["ms"])
            except Exception as e:  # noqa: BLE001  (a config that does not compile is a row of the report)
                r = dict(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
            r.update(shape=p.name, form=form, tile=dataclasses.asdict(tile))
            out.append(r)
            log(f"  sweep {form:5s} {_tile_label(tile):34s} "
                + (f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TF/s {'ok' if r['ok'] else 'WRONG'}" if "ms" in r
                   else r["error"]))
    return out


def run_int64(device, dtype, log):
    """dsd with a dense operand of more than 2**31 elements: the launcher must pick int64 offsets."""
    h = 2048
    k_blocks = (2**31 // h) // BLOCK + 2
    rhs = torch.randn(k_blocks * BLOCK, h, device=device, dtype=dtype)
    cols = torch.tensor([0, k_blocks // 2, k_blocks - 1], dtype=torch.int16, device=device)
    nnz = cols.numel()
    offsets = torch.tensor([0, nnz], dtype=torch.int32, device=device)
    rows = torch.zeros(nnz, dtype=torch.int16, device=device)
    data = torch.randn(nnz, BLOCK, BLOCK, device=device, dtype=dtype)
    # transpose metadata of a one-row matrix: one block per column
    offsets_t = torch.zeros(k_blocks + 1, dtype=torch.int32, device=device)
    offsets_t[1:] = torch.cumsum(torch.bincount(cols.long(), minlength=k_blocks), 0).int()
    out = torch.full((BLOCK, h), float("nan"), device=device, dtype=dtype)
    blocksparse.dsd((BLOCK, k_blocks * BLOCK), data, offsets, rows, cols, offsets_t, rows,
                    torch.arange(nnz, dtype=torch.int32, device=device), False, rhs, out)
    timing.synchronize(device)
    ref = sum(data[j].float() @ rhs[int(c) * BLOCK:(int(c) + 1) * BLOCK].float() for j, c in enumerate(cols.tolist()))
    r = checked(compare(out, ref), dtype)
    r.update(rhs_elements=rhs.numel(), int64=blocksparse._needs_int64(blocksparse._max_offset(rhs.shape, rhs.stride())))
    log(f"int64: dsd with a [{rhs.shape[0]}, {h}] operand ({rhs.numel() / 2**31:.2f} x 2**31 elements): "
        f"rel err {r['rel_err']:.1e} {'ok' if r['ok'] else 'WRONG'}")
    del rhs
    return r


def _stk_status(s: dict) -> str:
    if not s:
        return "-"
    if s.get("crashed"):
        return "CRASHED"
    if s.get("refused"):
        return "refused"
    return "ok" if s.get("ok") else "WRONG"


def _tile_label(t) -> str:
    d = t if isinstance(t, dict) else dataclasses.asdict(t)
    return (f"{d['block_m']}x{d['block_n']}x{d['block_k']} g{d['group']} w{d['num_warps']} s{d['num_stages']} "
            f"p{d['programs_per_sm']}" + (" pairs" if d.get("pairs") else "") + (" affine" if d.get("affine") else ""))


# ------------------------------------------------------------------------------------------
# Report


def table(shapes_res) -> str:
    head = (f"{'shape':9s} {'call':22s} {'ms':>8s} {'TF/s':>7s} {'dense':>7s} {'%dense':>6s} {'gmm ms':>8s} "
            f"{'x gmm':>6s} {'stk ms':>8s} {'vs stk':>6s} {'rel err':>8s} stk")
    lines = [head, "-" * len(head)]
    for name, res in shapes_res.items():
        for r in res["rows"]:
            s = r.get("stk", {})
            status = _stk_status(s)
            lines.append(f"{name:9s} {r['call']:22s} {r['ms']:8.3f} {r['tflops']:7.1f} {r['dense_tflops']:7.1f} "
                         f"{r['vs_dense']:6.0%} {r.get('gmm_ms', float('nan')):8.3f} {r.get('vs_gmm', float('nan')):6.2f} "
                         f"{s.get('ms', float('nan')):8.3f} {r.get('vs_stk', float('nan')):6.2f} "
                         f"{r['rel_err']:8.1e} {status}" + ("" if r["ok"] else "  OURS WRONG"))
    best = {}
    for name, res in shapes_res.items():
        for r in res["sweep"]:
            if r.get("ok") and (best.get((name, r["form"])) is None or r["ms"] < best[(name, r["form"])]["ms"]):
                best[(name, r["form"])] = r
    if best:
        lines.append("")
        lines.append("sweep: best tile per call form (default first in SWEEP)")
        for (name, form), r in best.items():
            default = next(x for x in shapes_res[name]["sweep"] if x["form"] == form)
            lines.append(f"  {name:9s} {form:5s} {_tile_label(r['tile']):34s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TF/s"
                         f"  (default {default.get('ms', float('nan')):.3f} ms)")
    return "\n".join(lines)


def targets(shapes_res, int64, timed=True) -> dict:
    """The issue's targets; the speed ones are ``None`` (not applicable) without a GPU."""
    rows = [r for res in shapes_res.values() for r in res["rows"]]
    big = [r for r in rows if r["shape"] in TARGET_SHAPES]
    dense = [f"{r['shape']}/{r['call']} {r['vs_dense']:.0%}" for r in big if r["vs_dense"] < 0.7]
    stk_correct = [r for r in rows if r.get("stk", {}).get("ok")]
    slower = [f"{r['shape']}/{r['call']} {r['vs_stk']:.2f}x" for r in stk_correct if r.get("vs_stk", 1) < 1.0]
    # Issue 32: the weight gradients and the backward products within 1.05x of torch._grouped_mm over
    # the same padded groups (the layout copy a grouped GEMM would add not counted).
    behind = [f"{r['shape']}/{r['call']} {r['vs_gmm']:.2f}x" for r in big
              if r["call"].startswith("bwd") and r.get("vs_gmm", 0) > 1.05]
    wrong = [f"{r['shape']}/{r['call']}" for r in rows if not r["ok"]]
    wrong += [f"{n}/row_indices" for n, res in shapes_res.items() if not res["row_indices_ok"]]
    if int64 is not None and not int64["ok"]:
        wrong.append("int64 dsd")
    return {
        "each_kernel_70pct_of_dense": dict(met=(not dense) if big and timed else None, misses=dense),
        "backward_within_1.05x_of_grouped_mm": dict(met=(not behind) if big and timed else None, misses=behind),
        "never_slower_than_stk_where_stk_correct": dict(met=(not slower) if timed else None, misses=slower,
                                                        compared=len(stk_correct)),
        "all_checks_pass": dict(met=not wrong, misses=wrong),
    }


def environment(device) -> dict:
    """:func:`~megablocks_ascend.bench.report.environment`, and whether CUDA's matmuls may use TF32."""
    return dict(report.environment(device), tf32=bool(torch.backends.cuda.matmul.allow_tf32))


def run(shapes, device, dtype, *, quick, sweep=True, stk=True, int64=True, log, out_dir) -> dict:
    """The whole benchmark at ``shapes``: ours per call (checked, timed, against dense and, on
    CUDA, grouped), the sweep, stk's own kernels (child processes), the int64 case (CUDA); the
    report with its targets."""
    dtype_name = str(dtype).split(".")[-1]
    out = dict(environment=environment(device), dtype=dtype_name, block=BLOCK, shapes=shapes,
               default_tiles={k: dataclasses.asdict(devices.cube_tile(k, dtype, BLOCK, 4096, devices.target(device)))
                              for k in devices.CUBE_KINDS})
    log(f"environment: {json.dumps(out['environment'])}")
    t0 = time.perf_counter()
    results = {}
    for name, shape in shapes.items():
        torch.manual_seed(0)
        results[name] = run_shape(name, shape, device, dtype, sweep=sweep, quick=quick, log=log)
        timing.empty_cache(device)
    if stk:
        # One child process for all of stk's calls; those predicted to read out of bounds last, so
        # a fault costs one restart at most per such call.
        rows = [r for res in results.values() for r in res["rows"]]
        pairs = sorted(((r["shape"], r["call"]) for r in rows),
                       key=lambda sc: next(r["stk_int16_overflow_predicted"] for r in rows
                                           if (r["shape"], r["call"]) == sc))
        log("stk's own kernels (child processes):")
        stk_results = stk_runs(pairs, dtype, quick, log, out_dir, device)
        for r in rows:
            s = stk_results.get((r["shape"], r["call"]), {})
            r["stk"] = s
            if s.get("ms"):
                r["vs_stk"] = s["ms"] / r["ms"]
            log(f"  stk  {r['shape']:9s} {r['call']:22s} {s.get('ms', float('nan')):8.3f} ms  rel err "
                f"{s.get('rel_err', float('nan')):.1e} {_stk_status(s)}"
                + (" (int16 overflow predicted)" if r["stk_int16_overflow_predicted"] else ""))
    large = run_int64(device, dtype, log) if int64 and device.type == "cuda" else None
    out.update(results=results, int64=large, targets=targets(results, large, timed=device.type == "cuda"),
               seconds=round(time.perf_counter() - t0, 1))
    log("")
    log(f"{dtype_name}, block {BLOCK}; ms = median of do_bench; dense = cuBLAS torch.mm of the same FLOPs and "
        "layouts; %dense = dense ms / ms; vs stk = stk ms / ms (stk's own kernels, child processes)")
    log(table(results))
    for key, t in out["targets"].items():
        verdict = "n/a (no GPU, or not at the issue's shapes)" if t["met"] is None else \
            ("MET" if t["met"] else "MISSED")
        log(f"target {key}: {verdict} {(t.get('misses') or '') if t['met'] is False else ''}")
    return out


def _child(argv=None) -> None:
    """A child process of :func:`stk_runs`: stk's kernels on the pairs it is given."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--stk-child", required=True)
    ap.add_argument("--stk-out", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--device", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    stk_child([tuple(x) for x in json.loads(a.stk_child)], a.stk_out, a.quick, a.dtype, a.device)


if __name__ == "__main__":
    _child()

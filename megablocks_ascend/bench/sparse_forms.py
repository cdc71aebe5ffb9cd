"""``bench``'s ``sparse`` section: the sparse dMoE's block-sparse products in their two forms, side by side.

The two forms of the products MegaBlocks' sparse dMoE (``mlp_impl="sparse"``) runs through stk:

``ours``                 our block-sparse Triton kernels (:mod:`megablocks_ascend.kernels.blocksparse`),
                         the default;
``grouped GEMM + copy``  a grouped GEMM over the experts' padded groups plus the copy between stk's
                         ``[blocks, 128, 128]`` data and the dense ``[rows, ffn]`` layout
                         (:mod:`~megablocks_ascend.bench.sparse_grouped`: ``npu_grouped_matmul`` on an
                         NPU, ``torch._grouped_mm`` on CUDA and the CPU).

For each step config whose ffn is a whole number of 128-wide blocks, at the step's tokens:

* each of the six products of a training step (:data:`~megablocks_ascend.bench.blocksparse.CALLS`:
  the two forward ones, the data gradients and the two weight gradients), on MegaBlocks' own topology
  of a random routing, checked against a float32 reference (every element written, relative L2 error
  within :data:`~megablocks_ascend.bench.blocksparse.TOL`), then timed;
* the whole sparse dMoE training step in each form (the step harness's ``sparse`` and ``sparse-gmm``
  variants, eager and, where the device has graph capture, captured), both checked against the same
  grouped step (upstream's on CUDA, the ``torch`` backend's elsewhere) on the same parameters.

Which form an NPU should run only an NPU can say: ``bench`` runs this section by default there, and on
other devices when ``--sections`` names it. Ours stays the default until then.
"""

from __future__ import annotations

import torch

from megablocks_ascend.bench import blocksparse, sparse_grouped, steps, timing
from megablocks_ascend.kernels import blocksparse as ours

FORMS = (("ours", ours), ("grouped GEMM + copy", sparse_grouped))
IMPL_OF_MLP = dict(zip(("sparse", "sparse-gmm"), (impl for impl, _ in FORMS)))  # the step harness's mlp_impl
DTYPE = torch.bfloat16  # as the timed steps


def configs(plan_configs: dict) -> dict:
    """The step configs the section runs: those whose ffn is a whole number of stk's blocks."""
    return {name: c for name, c in plan_configs.items() if c["ffn"] % blocksparse.BLOCK == 0}


def product_rows(name: str, c: dict, tokens: int, device: torch.device, time_fn, log) -> list[dict]:
    """The six products of config ``c`` in both forms: checked, then timed by ``time_fn(fn)``."""
    p = blocksparse.Problem(name, tokens, c["H"], c["ffn"], c["E"], c["k"], device, DTYPE)
    log(f"[sparse {name}] T={tokens} H={c['H']} ffn={c['ffn']} E={c['E']} top_k={c['k']}: {p.Tp} padded rows, "
        f"{p.nnz} blocks")
    rows = []
    for call, form in blocksparse.CALLS:
        _, ops = p.operands(call)
        ref = p.reference(form, ops)
        for impl, module in FORMS:
            row = dict(section="sparse", case=name, item=call, impl=impl)
            try:
                out = p.out(form)
                p.run(module, form, ops, out)
                check = blocksparse.checked(blocksparse.compare(out, ref), DTYPE)
                row.update(check_ok=check.pop("ok"), **check)
                row.update(time_fn(lambda module=module, out=out: p.run(module, form, ops, out)))
            except Exception as e:  # noqa: BLE001 - an error row; the run goes on
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}", check_ok=False)
            rows.append(row)
        del ref
    del p
    timing.empty_cache(device)
    return rows


def step_rows(names: list, device: torch.device, reference: str, *, timed: bool, graph: bool,
              settings: steps.Settings, log) -> list[dict]:
    """The whole sparse dMoE step of the configs ``names`` (of ``settings.configs``) in both forms
    (ours: ``sparse``, the other: ``sparse-gmm``), eager and (``graph``) captured, each checked against
    ``reference``'s grouped step on the same parameters."""
    modes = ("eager", "graph") if graph else ("eager",)
    variants = [steps.Variant(n, "dMoE", reference, "eager", "bf16", "grouped", "mlp", "empty") for n in names]
    variants += [steps.Variant(n, "dMoE", "ascend", mode, "bf16", mlp, "mlp", "empty")
                 for n in names for mlp in IMPL_OF_MLP for mode in modes]
    rows = []
    for r in steps.run(variants, device, settings, reference, log):
        if r["mlp_impl"] not in IMPL_OF_MLP or r["backend"] != "ascend":
            continue  # (the reference's grouped step: what both are checked against)
        row = dict(section="sparse", case=r["config"], item=f"step {r['mode']}", impl=IMPL_OF_MLP[r["mlp_impl"]],
                   ms=r.get("wall_ms") if timed else None, graph_ms=None, host_ms=r.get("host_ms") if timed else None,
                   peak_mib=r.get("peak_mib"), launches=r.get("launches"), syncs=r.get("syncs"),
                   check_ok=r.get("ok", False) and "error" not in r, err_vs_reference=r.get("err"))
        if "error" in r:
            row["error"] = r["error"]
        if not timed:
            row["why"] = f"not timed: {timing.timer(device).how}"
        rows.append(row)
    return rows

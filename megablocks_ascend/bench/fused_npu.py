"""torch_npu's fused MoE routing ops, compared with ours where their documented semantics match.

MindSpeed's ``--moe-permute-fusion`` and its token dispatchers route tokens with three torch_npu ops.
What each does, in our words, from Huawei's documentation (the torch_npu API pages of the Ascend
op-plugin docs, the aclnn pages of ``aclnnMoeTokenPermute`` / ``aclnnMoeTokenUnpermute`` /
``aclnnMoeInitRoutingV2``, and MindSpore's identical ``ops.moe_token_permute`` / ``unpermute``):

``npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)``
    ``tokens`` [T, H] (bf16; later CANN also fp16, fp32), ``indices`` [T, k] (or [T]: k = 1) the
    expert of each of a token's k slots, int32 or int64, k <= 512. Sorts the T*k assignments by
    expert (``first = argsort(flatten(indices))``), returns ``sorted_indices = argsort(first)``
    (int32 [T*k]: the output row of each assignment) and ``permuted_tokens`` with
    ``permuted_tokens[sorted_indices[a]] = tokens[a // k]``; ``num_out_tokens`` keeps the first rows
    of that order (all by default); ``padded_mode=True`` is documented as not supported. Its
    backward (``npu_moe_token_permute_grad``) sums each token's k row gradients.
``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None)``
    ``out[t] = sum_j permuted_tokens[sorted_indices[t*k + j]] * probs[t, j]`` ([T, H]; without
    ``probs``, k = 1 and no sum); ``sorted_indices`` int32 without repeats, ``probs`` [T, k]; bf16
    (some versions: bf16 only); ``padded_mode=True`` not supported. Its backward
    (``npu_moe_token_unpermute_grad``) gives the gradients of ``permuted_tokens`` and ``probs``.
``npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0, active_expert_range=[], row_idx_type=0)``
    ``x`` [T, H], ``expert_idx`` [T, k] int32. Sorts the assignments by expert and returns
    ``expanded_x`` [T*k, H] (the token rows in expert order), ``expanded_row_idx`` int32 [T*k]
    (the aclnn formula: ``expanded_row_idx[sorted_row_idx[i]] = i``, the row of each assignment;
    ``row_idx_type`` 0 / 1 names a "gather" / "scatter" form of it), the tokens per expert
    (``expert_tokens_num_type`` 1: counts, int64 [E]) and ``expanded_scale`` (quantisation only).
    The torch_npu page documents ``active_num`` as unused and to equal T*k, ``drop_pad_mode`` 0 only
    (dropless), ``expert_tokens_num_type`` 1 or 2, ``expert_tokens_num_flag`` True, ``quant_mode`` -1
    (none) or 1, and the op for inference (no backward).

How ours is mapped onto them (:func:`comparisons`; the dropless layout, bf16), each compared on the
same values, per assignment, so that the order of assignments inside one expert (a stable sort is
not documented) does not matter:

=================  ====================================================  ======================================
item               ours                                                  theirs
=================  ====================================================  ======================================
permute            ``ops.prepare_routing`` (dropless) + ``gather``       ``npu_moe_token_permute(x, top, T*k)``
permute backward   ``scatter`` (unweighted) of the row gradients         autograd of it (tokens' gradient)
unpermute          ``scatter(y, indices, bin_ids, w, bins, k)``          ``npu_moe_token_unpermute(y,
                                                                          argsort(indices), w.view(T, k))``
unpermute backward ``gather`` weighted (rows) + ``scatter_wgrad`` (w)    autograd of it (rows, probs)
init_routing_v2    ``ops.prepare_routing`` (dropless) + ``gather``       ``npu_moe_init_routing_v2`` (dropless,
                                                                          counts, no quantisation)
=================  ====================================================  ======================================

Where they do not apply (:data:`NOT_APPLICABLE`): the binned ops (MegaBlocks' ``MoE``: each expert
keeps at most ``capacity`` of its assignments), the padded ops (``dMoE``'s sparse path: each
expert's rows padded with zero rows to a block multiple), and our routing preparation alone.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megablocks_ascend import backends, ops, reference
from megablocks_ascend.bench import precision
from megablocks_ascend.kernels import routing

OPS = ("npu_moe_token_permute", "npu_moe_token_unpermute", "npu_moe_init_routing_v2")

NOT_APPLICABLE = [
    dict(ops="binned_gather, binned_scatter, binned_scatter_wgrad",
         alternatives="npu_moe_token_permute, npu_moe_init_routing_v2",
         why="capacity-bounded (MegaBlocks' MoE keeps each expert's first `capacity` assignments, an [E, capacity, H] "
             "buffer with zero rows): permute's num_out_tokens keeps the first rows of the whole expert-sorted order, "
             "not each expert's first `capacity`; init_routing_v2's per-expert capacity (drop_pad_mode=1) is "
             "documented as not supported by torch_npu (drop_pad_mode 0 only)"),
    dict(ops="padded_gather, padded_scatter, padded_scatter_wgrad",
         alternatives="npu_moe_token_permute, npu_moe_token_unpermute",
         why="padded_mode=True is documented as not supported, and MegaBlocks' padded layout (each expert's rows "
             "rounded up to a block of 128 with zero rows, for the block-sparse matmuls) has no counterpart"),
    dict(ops="prepare_routing (alone)", alternatives="npu_moe_init_routing_v2",
         why="init_routing_v2 always gathers the token rows too: it is compared with our preparation + gather"),
    dict(ops="gather, scatter, scatter_wgrad (alone)", alternatives="npu_moe_token_permute / unpermute",
         why="compared as the pairs the fused ops compute: permute (+ its backward) = preparation + gather "
             "(+ unweighted scatter); unpermute (+ its backward) = weighted scatter (+ weighted gather and "
             "scatter_wgrad)"),
]


def torch_npu_ops():
    """``(torch_npu, missing)``: the module (None if it does not import) and which of :data:`OPS`
    it lacks."""
    try:
        import torch_npu  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001 - not installed, or installed without CANN
        return None, [f"torch_npu does not import ({type(e).__name__}: {str(e)[:120]})"]
    return torch_npu, [name for name in OPS if not callable(getattr(torch_npu, name, None))]


@dataclasses.dataclass
class Comparison:
    """One item: ``ours()`` and ``theirs()`` each return ``{output: tensor}`` in the same layout
    (per assignment or per token), and are what is timed; ``golden(dtype)`` computes the same outputs
    on the CPU with the plain-PyTorch reference in ``dtype`` (the precision verdict's simulation and
    golden); ``exact`` outputs must be equal bit for bit (copies)."""
    item: str
    alternative: str
    mapping: str
    ours: Callable[[], dict]
    theirs: Callable[[], dict]
    golden: Callable[[torch.dtype], dict]
    exact: tuple = ()
    notes: dict = dataclasses.field(default_factory=dict)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """``inv[perm[i]] = i`` (int64)."""
    inv = torch.empty_like(perm, dtype=torch.int64)
    inv[perm.long()] = torch.arange(perm.numel(), device=perm.device)
    return inv


def _prepared(top: torch.Tensor, num_experts: int):
    """Our routing preparation of the router's ids (dropless, with its route map), as a grouped
    dMoE step does it."""
    with backends.use_backend("ascend"):
        return ops.prepare_routing(top, num_experts, 0, routing.DROPLESS)


def comparisons(d, tnpu) -> list[Comparison]:
    """The items of the module doc on the problem ``d`` (a :class:`~megablocks_ascend.bench.
    routing_ops.Data`), calling ``tnpu`` (torch_npu, or a stand-in written from its docs)."""
    T, H, E, k, N = d.T, d.H, d.E, d.k, d.N
    top = d.top.long()  # [T, k], the router's ids
    x = d.x
    gen = torch.Generator(device=d.device).manual_seed(7)
    rand = (lambda *s: torch.randn(*s, device=d.device, generator=gen).to(d.dtype))  # noqa: E731
    g_rows = rand(N, H)  # a gradient per assignment (its permuted row's)
    y = rand(N, H)  # expert outputs per assignment
    g_tok = rand(T, H)  # a gradient per token
    w = d.w  # router weights, per assignment (t * k + j)
    indices, bin_ids, bins, counts, _ = _prepared(top, E)
    inv = _inverse(indices)  # our row of each assignment
    y_rows = y[indices.long()]  # ours and theirs take the same permuted rows: row r holds indices[r]'s

    # -- permute: preparation + gather / npu_moe_token_permute; backward: unweighted scatter / its autograd
    def ours_permute():
        idx, ids, b, _, _ = _prepared(top, E)
        out = routing.gather(x, idx, ids, None, b, k)
        return {"rows": out[_inverse(idx)]}

    def theirs_permute():
        permuted, sorted_indices = tnpu.npu_moe_token_permute(x, top, num_out_tokens=N)
        return {"rows": permuted[sorted_indices.long()]}

    def golden_permute(dtype):
        return {"rows": x.to("cpu", dtype)[torch.arange(N) // k]}

    def ours_permute_bwd():
        return {"tokens_grad": routing.scatter(g_rows[indices.long()], indices, bin_ids, None, bins, k)}

    x_leaf = x.detach().clone().requires_grad_()
    permuted_graph = {}

    def theirs_permute_bwd():
        if "out" not in permuted_graph:
            permuted, sorted_indices = tnpu.npu_moe_token_permute(x_leaf, top, num_out_tokens=N)
            rows_grad = torch.empty_like(permuted)
            rows_grad[sorted_indices.long()] = g_rows
            permuted_graph.update(out=permuted, grad=rows_grad)
        (grad,) = torch.autograd.grad(permuted_graph["out"], x_leaf, permuted_graph["grad"], retain_graph=True)
        return {"tokens_grad": grad}

    def golden_permute_bwd(dtype):
        return {"tokens_grad": g_rows.to("cpu", dtype).view(T, k, H).sum(1)}

    # -- unpermute: weighted scatter / npu_moe_token_unpermute; backward: weighted gather + wgrad / its autograd
    probs = w.view(T, k)
    sorted_for_unpermute = inv.int()

    def ours_unpermute():
        return {"out": routing.scatter(y_rows, indices, bin_ids, w, bins, k)}

    def theirs_unpermute():
        return {"out": tnpu.npu_moe_token_unpermute(y_rows, sorted_for_unpermute, probs=probs)}

    def golden_unpermute(dtype):
        yc, wc = y.to("cpu", dtype).view(T, k, H), w.to("cpu", dtype).view(T, k, 1)
        return {"out": (yc * wc).sum(1)}

    def ours_unpermute_bwd():
        return {"rows_grad": routing.gather(g_tok, indices, bin_ids, w, bins, k),
                "probs_grad": routing.scatter_wgrad(y_rows, g_tok, indices, bin_ids, bins, k)}

    y_leaf, probs_leaf = y_rows.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    unpermuted_graph = {}

    def theirs_unpermute_bwd():
        if "out" not in unpermuted_graph:
            unpermuted_graph["out"] = tnpu.npu_moe_token_unpermute(y_leaf, sorted_for_unpermute, probs=probs_leaf)
        gy, gp = torch.autograd.grad(unpermuted_graph["out"], (y_leaf, probs_leaf), g_tok, retain_graph=True)
        return {"rows_grad": gy, "probs_grad": gp.reshape(-1)}

    def golden_unpermute_bwd(dtype):
        # rows in our (expert) order: row r is assignment indices[r] = (token t, slot j)
        a = indices.long().cpu()
        g, wc, yr = g_tok.to("cpu", dtype), w.to("cpu", dtype), y_rows.to("cpu", dtype)
        return {"rows_grad": g[a // k] * wc[a][:, None],
                "probs_grad": torch.zeros(N, dtype=dtype).index_copy_(0, a, (yr * g[a // k]).sum(1))}

    # -- init_routing_v2: preparation + gather / npu_moe_init_routing_v2 (forward only)
    init_notes = {}

    def ours_init():
        idx, ids, b, tpe, _ = _prepared(top, E)
        out = routing.gather(x, idx, ids, None, b, k)
        return {"rows": out[_inverse(idx)], "tokens_per_expert": tpe.long()}

    def theirs_init():
        expanded_x, row_idx, per_expert, _ = tnpu.npu_moe_init_routing_v2(
            x, top.int(), active_num=N, expert_capacity=0, expert_num=E, drop_pad_mode=0,
            expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, E],
            row_idx_type=0)
        row_of_assignment = row_idx.long()
        # The aclnn formula gives the row of each assignment; if the output reads the other way
        # (the assignment of each row), say so and compare that way.
        as_row = expanded_x[row_of_assignment]
        want = x[torch.arange(N, device=x.device) // k]
        if torch.equal(as_row, want):
            init_notes["expanded_row_idx"] = "row of each assignment (the aclnn formula)"
        else:
            alt = expanded_x[_inverse(row_idx)]
            if torch.equal(alt, want):
                init_notes["expanded_row_idx"] = "assignment of each row (not the aclnn formula's reading)"
                as_row = alt
            else:
                init_notes["expanded_row_idx"] = "neither reading reproduces the token rows"
        return {"rows": as_row, "tokens_per_expert": per_expert.long()}

    def golden_init(dtype):
        return {"rows": x.to("cpu", dtype)[torch.arange(N) // k],
                "tokens_per_expert": torch.bincount(top.reshape(-1).cpu(), minlength=E)}

    m_permute = ("ours: ops.prepare_routing(top, E, 0, DROPLESS) + routing.gather(x, indices, bin_ids, None, bins, k); "
                 "theirs: npu_moe_token_permute(x, top [T,k] int64, num_out_tokens=T*k); compared per assignment "
                 "(ours: row argsort(indices)[a], theirs: row sorted_indices[a])")
    return [
        Comparison("permute", "npu_moe_token_permute", m_permute, ours_permute, theirs_permute, golden_permute,
                   exact=("rows",)),
        Comparison("permute backward", "npu_moe_token_permute (autograd)",
                   "ours: routing.scatter(row grads in our row order, indices, bin_ids, None, bins, k); theirs: "
                   "torch.autograd.grad of npu_moe_token_permute with the same gradient per assignment",
                   ours_permute_bwd, theirs_permute_bwd, golden_permute_bwd),
        Comparison("unpermute", "npu_moe_token_unpermute",
                   "ours: routing.scatter(y, indices, bin_ids, w, bins, k); theirs: npu_moe_token_unpermute(y, "
                   "sorted_indices=argsort(indices) int32, probs=w.view(T, k)), y the same rows (row r: assignment "
                   "indices[r])", ours_unpermute, theirs_unpermute, golden_unpermute),
        Comparison("unpermute backward", "npu_moe_token_unpermute (autograd)",
                   "ours: routing.gather(g, indices, bin_ids, w, bins, k) (rows) and routing.scatter_wgrad(y, g, "
                   "indices, bin_ids, bins, k) (probs); theirs: torch.autograd.grad of npu_moe_token_unpermute "
                   "w.r.t. permuted_tokens and probs", ours_unpermute_bwd, theirs_unpermute_bwd, golden_unpermute_bwd),
        Comparison("init_routing_v2", "npu_moe_init_routing_v2",
                   "ours: ops.prepare_routing(top, E, 0, DROPLESS) + routing.gather; theirs: "
                   "npu_moe_init_routing_v2(x, top int32, active_num=T*k, expert_capacity=0, expert_num=E, "
                   "drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True, quant_mode=-1, "
                   "active_expert_range=[0, E], row_idx_type=0); forward only (documented for inference)",
                   ours_init, theirs_init, golden_init, exact=("rows", "tokens_per_expert"), notes=init_notes),
    ]


def compare(c: Comparison, dtype: torch.dtype) -> dict:
    """Ours against theirs on one item: every output's precision verdict (device = each of them,
    against :mod:`precision`'s golden and simulation), exact equality where the item is a copy, and
    the largest difference between ours and theirs."""
    mine, theirs = c.ours(), c.theirs()
    simulation, golden = c.golden(dtype), c.golden(precision.golden_dtype(dtype))
    out = {"outputs": {}, "ok": True}
    for name in mine:
        a, b = mine[name], theirs.get(name)
        res = {}
        if b is None or tuple(a.shape) != tuple(b.shape):
            res.update(ok=False, why=f"shapes differ: ours {tuple(a.shape)}, theirs "
                                     f"{None if b is None else tuple(b.shape)}")
        elif not a.is_floating_point():
            res.update(ok=bool(torch.equal(a.cpu(), b.cpu())) and bool(torch.equal(a.cpu(), golden[name].cpu())),
                       equal=bool(torch.equal(a.cpu(), b.cpu())))
        else:
            v_ours = precision.judge(name, a, simulation[name], golden[name], dtype)
            v_theirs = precision.judge(name, b, simulation[name], golden[name], dtype)
            res.update(ours=v_ours.as_dict(), theirs=v_theirs.as_dict(),
                       max_abs_diff=float((a.float() - b.float()).abs().max()) if a.numel() else 0.0,
                       equal=bool(torch.equal(a, b)))
            res["ok"] = v_ours.ok and (res["equal"] if name in c.exact else True)
        out["outputs"][name] = res
        out["ok"] = out["ok"] and res["ok"]
    return out


def reference_golden(op: str, args, dtype):
    """``(simulation, golden)`` of a routing op from :mod:`megablocks_ascend.reference` on the CPU."""
    return precision.cpu_references(getattr(reference, op), args, dtype)

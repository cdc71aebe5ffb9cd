"""A stand-in for torch_npu's fused MoE routing ops, written from their documentation only.

Each op checks the arguments as the docs constrain them (names, ranks, dtypes, the values the
torch_npu pages say are supported) and computes what the docs' formulas say with plain torch ops
(argsort, indexing, sums): nothing here calls megablocks_ascend. Sources, read through the Ascend
op-plugin docs (torch_npu API pages), the aclnn pages (``aclnnMoeTokenPermute``,
``aclnnMoeTokenUnpermute``, ``aclnnMoeInitRoutingV2``) and MindSpore's ``ops.moe_token_permute`` /
``ops.moe_token_unpermute``, which document the same kernels:

* permute: ``first = argsort(flatten(indices))``, ``sorted_indices = argsort(first)`` (int32),
  ``permuted[sorted_indices[i]] = tokens[i // topK]``; ``num_out_tokens`` keeps the first rows;
  ``padded_mode`` must be False; indices int32/int64, [T] or [T, k], k <= 512.
* unpermute: ``out[i] = sum_j permuted[sorted_indices[i*k + j]] * probs[i, j]``; without ``probs``
  k = 1; ``sorted_indices`` int32; ``padded_mode`` False.
* init_routing_v2: expert_idx int32 [T, k]; ``expanded_row_idx[sorted_row_idx[i]] = i`` (the aclnn
  formula: the row of each assignment) for ``row_idx_type`` 0, the other direction for 1;
  ``expanded_x[expanded_row_idx[a]] = x[a // k]``; ``active_num`` = T*k, ``drop_pad_mode`` 0,
  ``expert_tokens_num_type`` 1 (counts, int64) or 2, ``expert_tokens_num_flag`` True, ``quant_mode``
  -1 or 1 (the values the torch_npu page documents as supported).

The docs do not say whether the sort is stable; this stand-in sorts stably. Permute and unpermute
are autograd functions (torch_npu registers their backward ops); init_routing_v2 is documented for
inference and has no backward here. ``calls`` records every call's keyword arguments.
"""

import types

import torch

FLOATS = (torch.bfloat16, torch.float16, torch.float32)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tokens, indices, num_out_tokens):
        k = 1 if indices.ndim == 1 else indices.shape[1]
        first = torch.argsort(indices.reshape(-1), stable=True)
        sorted_indices = torch.argsort(first).to(torch.int32)
        rows = tokens[first // k][:num_out_tokens]
        ctx.save_for_backward(sorted_indices)
        ctx.k, ctx.num_tokens, ctx.num_out = k, tokens.shape[0], num_out_tokens
        ctx.mark_non_differentiable(sorted_indices)
        return rows, sorted_indices

    @staticmethod
    def backward(ctx, grad_rows, _):
        (sorted_indices,) = ctx.saved_tensors
        row = sorted_indices.long()
        full = torch.zeros(row.numel(), grad_rows.shape[1], dtype=torch.float32, device=grad_rows.device)
        kept = row < ctx.num_out
        full[kept] = grad_rows.float()[row[kept]]
        return full.view(ctx.num_tokens, ctx.k, -1).sum(1).to(grad_rows.dtype), None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted, sorted_indices, probs):
        rows = permuted[sorted_indices.long()].float()
        ctx.save_for_backward(permuted, sorted_indices, probs)
        if probs is None:
            return rows.to(permuted.dtype)
        t, k = probs.shape
        return (rows.view(t, k, -1) * probs.float()[:, :, None]).sum(1).to(permuted.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        permuted, sorted_indices, probs = ctx.saved_tensors
        row = sorted_indices.long()
        g = grad_out.float()
        grad_rows = torch.zeros(permuted.shape, dtype=torch.float32, device=permuted.device)
        if probs is None:
            grad_rows[row] = g
            return grad_rows.to(permuted.dtype), None, None
        t, k = probs.shape
        grad_rows[row] = (g[:, None, :] * probs.float()[:, :, None]).reshape(t * k, -1)
        grad_probs = (permuted[row].float().view(t, k, -1) * g[:, None, :]).sum(-1)
        return grad_rows.to(permuted.dtype), None, grad_probs.to(probs.dtype)


class FakeTorchNpu(types.ModuleType):
    def __init__(self):
        super().__init__("torch_npu")
        self.calls = []

    def npu_moe_token_permute(self, tokens, indices, num_out_tokens=None, padded_mode=False):
        self.calls.append(dict(op="npu_moe_token_permute", tokens=tokens, indices=indices,
                               num_out_tokens=num_out_tokens, padded_mode=padded_mode))
        assert tokens.ndim == 2 and tokens.dtype in FLOATS, (tokens.shape, tokens.dtype)
        assert indices.dtype in (torch.int32, torch.int64), indices.dtype
        assert indices.ndim in (1, 2) and indices.shape[0] == tokens.shape[0], (indices.shape, tokens.shape)
        assert indices.ndim == 1 or indices.shape[1] <= 512
        assert padded_mode is False, "padded_mode=True is documented as not supported"
        n = indices.numel()
        num_out = n if not num_out_tokens else num_out_tokens
        assert 0 <= num_out <= n, num_out_tokens
        return _Permute.apply(tokens, indices, num_out)

    def npu_moe_token_unpermute(self, permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                                restore_shape=None):
        self.calls.append(dict(op="npu_moe_token_unpermute", permuted_tokens=permuted_tokens,
                               sorted_indices=sorted_indices, probs=probs, padded_mode=padded_mode,
                               restore_shape=restore_shape))
        assert permuted_tokens.ndim == 2 and permuted_tokens.dtype in FLOATS
        assert sorted_indices.dtype == torch.int32 and sorted_indices.ndim == 1, sorted_indices.dtype
        assert sorted_indices.numel() == permuted_tokens.shape[0]
        assert torch.unique(sorted_indices).numel() == sorted_indices.numel(), "sorted_indices must not repeat"
        assert padded_mode is False and restore_shape is None
        if probs is not None:
            assert probs.ndim == 2 and probs.numel() == sorted_indices.numel(), probs.shape
        return _Unpermute.apply(permuted_tokens, sorted_indices, probs)

    def npu_moe_init_routing_v2(self, x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                                expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
                                expert_tokens_num_flag=False, quant_mode=0, active_expert_range=(), row_idx_type=0):
        self.calls.append(dict(op="npu_moe_init_routing_v2", x=x, expert_idx=expert_idx, scale=scale, offset=offset,
                               active_num=active_num, expert_capacity=expert_capacity, expert_num=expert_num,
                               drop_pad_mode=drop_pad_mode, expert_tokens_num_type=expert_tokens_num_type,
                               expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                               active_expert_range=list(active_expert_range), row_idx_type=row_idx_type))
        t, k = expert_idx.shape
        assert x.ndim == 2 and x.shape[0] == t and x.dtype in FLOATS
        assert expert_idx.dtype == torch.int32
        assert scale is None and offset is None
        assert active_num == t * k, "active_num: documented as unused and to equal NUM_ROWS * K"
        assert expert_capacity >= 0 and drop_pad_mode == 0, "drop_pad_mode: documented as 0 only"
        assert expert_tokens_num_type in (1, 2) and expert_tokens_num_flag is True
        assert quant_mode in (-1, 1) and row_idx_type in (0, 1)
        start, end = active_expert_range
        assert 0 <= start < end <= expert_num
        assert int(expert_idx.min()) >= start and int(expert_idx.max()) < end  # (all experts active here)
        order = torch.argsort(expert_idx.reshape(-1), stable=True)  # sorted_row_idx
        row_of_assignment = torch.argsort(order)
        expanded_row_idx = (row_of_assignment if row_idx_type == 0 else order).to(torch.int32)
        expanded_x = x[order // k]
        counts = torch.bincount(expert_idx.reshape(-1).long() - start, minlength=end - start).to(torch.int64)
        if expert_tokens_num_type == 2:
            nz = counts.nonzero().reshape(-1)
            counts = torch.stack([nz + start, counts[nz]], 1)
        expanded_scale = torch.empty(t * k, dtype=torch.float32, device=x.device)
        return expanded_x, expanded_row_idx, counts, expanded_scale


class FakeNpuModule(types.ModuleType):
    """``torch.npu`` of a machine that has an NPU but no way to time it here: it is available, and
    has neither events nor synchronisation (nor graph capture)."""

    def __init__(self):
        super().__init__("torch.npu")

    def is_available(self):
        return True

    def current_device(self):
        return 0

    def device_count(self):
        return 1

"""fused_linear_cross_entropy with the vocabulary sharded over a tensor-parallel group
(fastllm.parallel.loss routes a vocabulary-sharded DTensor head here): each rank holds its rows
of the head, and per chunk of tokens only (chunk,) vectors of statistics cross the ranks."""

import math

import torch

from fastllm._library import first_order_only
from fastllm.ops.fused_linear_cross_entropy import (
    _WHERE, _check_labels, _reduce, _scaled, check_fused_linear_cross_entropy_args, chunk_rows)


class _VocabParallel(torch.autograd.Function):
    """The chunked loss with the vocabulary sharded over `group`: per chunk each rank takes the
    max, sum of exponentials, target logit and sum of logits of its shard, and only those
    (chunk,) vectors are all-reduced; dX's partial sums are all-reduced once at the end, dW and
    db stay local. Grads are computed in the forward, as in the single-process op."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, vocab_start, vocab_size, group, ignore_index,
                reduction, label_smoothing, z_loss, cap):
        import torch.distributed as dist

        hidden2 = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # (H may be 0)
        flat = labels.reshape(-1)
        n, v_local = hidden2.shape[0], weight.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        _check_labels(flat, ignore_index, vocab_size)
        valid = (flat != ignore_index).nonzero()[:, 0]
        m = valid.numel()
        need = [ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        loss = hidden2.new_zeros(n, dtype=acc)
        gh = torch.zeros(hidden2.shape, dtype=acc, device=hidden.device) if need[0] else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need[1] else None
        gb = torch.zeros(v_local, dtype=acc, device=weight.device) if need[2] else None
        w = (1.0 / m if reduction == "mean" else 1.0) if m else 0.0
        eps = label_smoothing
        shard = -(-vocab_size // dist.get_world_size(group))  # the largest: every rank's chunks
        rows = chunk_rows(max(m, 1), shard, hidden.element_size(), hidden.device.type)
        # (one all_reduce per chunk)
        for c0 in range(0, m, rows):
            idx = valid[c0:c0 + rows]
            x = hidden2[idx]
            z = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
            zf = z.to(acc)
            if cap:
                zf = cap * torch.tanh(zf / cap)
            local_y = flat[idx] - vocab_start
            mine = (local_y >= 0) & (local_y < v_local)
            safe_y = torch.where(mine, local_y, 0)
            gmax = zf.max(1).values
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
            stats = torch.stack([torch.exp(zf - gmax[:, None]).sum(1),
                                 torch.where(mine, zf.gather(1, safe_y[:, None])[:, 0], 0.0),
                                 zf.sum(1)], 1)
            dist.all_reduce(stats, group=group)
            lse = gmax + stats[:, 0].log()
            # (eps 0: no smoothing term, whose 0 * -inf of a -inf-masked vocabulary was nan)
            smooth = eps * stats[:, 2] / vocab_size if eps else 0.0
            loss[idx] = lse - (1.0 - eps) * stats[:, 1] - smooth + z_loss * lse * lse
            if not any(need):
                continue
            g = torch.exp(zf - lse[:, None]) * (w * (1.0 + 2.0 * z_loss * lse))[:, None]
            g.sub_(w * eps / vocab_size)
            g.scatter_add_(1, safe_y[:, None], torch.where(mine, -w * (1.0 - eps), 0.0)[:, None]
                           .to(acc))
            if cap:
                g.mul_(1.0 - (zf / cap).square())
            g = g.to(z.dtype)
            if need[0]:
                gh[idx] = torch.mm(g, weight).to(acc)
            if need[1]:
                gw.add_(torch.mm(g.t(), x))
            if need[2]:
                gb.add_(g.sum(0, dtype=acc))
        if need[0]:
            dist.all_reduce(gh, group=group)
        grads = [None if t is None else t.to(src.dtype)
                 for t, src in ((gh, hidden), (gw, weight), (gb, weight))]
        if grads[0] is not None:
            grads[0] = grads[0].view(hidden.shape)
        ctx.save_for_backward(*[g for g in grads if g is not None])
        ctx.present = [g is not None for g in grads]
        return _reduce(loss, labels, ignore_index, reduction)

    @staticmethod
    @first_order_only("fastllm.vocab_parallel_fused_linear_cross_entropy")
    def backward(ctx, grad_loss):
        saved = iter(ctx.saved_tensors)
        gh, gw, gb = (_scaled(next(saved), grad_loss) if p else None for p in ctx.present)
        return gh, gw, gb, None, None, None, None, None, None, None, None, None


def vocab_parallel_fused_linear_cross_entropy(hidden, weight, labels, vocab_start, vocab_size,
                                              group=None, bias=None, ignore_index=-100,
                                              reduction="mean", label_smoothing=0.0, z_loss=0.0,
                                              logit_softcap=None):
    """fused_linear_cross_entropy with the vocabulary sharded over a tensor-parallel group.

    hidden: (..., H), the same on every rank; weight: (V_local, H), this rank's rows
    [vocab_start, vocab_start + V_local) of the (vocab_size, H) head; bias: (V_local,) or None;
    labels: (...) int64 global token ids, the same on every rank. Returns the full loss on every
    rank ("mean" or "sum"); grad_hidden is complete (all-reduced) on every rank, grad_weight and
    grad_bias are this rank's shard. The (tokens x V_local) logits never exist either.
    """
    check_fused_linear_cross_entropy_args(hidden, weight, labels, bias, ignore_index, reduction,
                                          label_smoothing, z_loss, logit_softcap)
    if reduction == "none":
        raise ValueError(f"{_WHERE}: the vocabulary-parallel form supports 'mean' and 'sum'")
    if not 0 <= int(vocab_start) <= int(vocab_size) - weight.shape[0]:  # (no collective)
        raise ValueError(f"{_WHERE}: this rank's rows [{vocab_start}, {vocab_start} + "
                         f"{weight.shape[0]}) are not inside the vocabulary of {vocab_size}")
    return _VocabParallel.apply(hidden, weight, bias, labels, int(vocab_start), int(vocab_size),
                                group, int(ignore_index), reduction, float(label_smoothing),
                                float(z_loss), logit_softcap)

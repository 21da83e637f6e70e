"""Cross-entropy over vocabulary-parallel logits."""

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel


def vocab_parallel_cross_entropy(logits, labels, ignore_index=-100):
    """Mean token cross-entropy. logits: (batch, seq, vocab), labels: (batch, seq) int64.

    When logits is a DTensor sharded on the vocabulary (Shard(-1), what the tensor-parallel
    lm_head returns) each rank computes its slice's max, sum of exponentials and target logit
    and only those per-token scalars are all-reduced (torch's loss_parallel): the full
    (batch, seq, vocab) logits never exist on one rank. Plain tensors take the ordinary path.
    Logits are upcast to fp32 before the softmax. Returns a 0-d fp32 tensor (a replicated
    DTensor under tensor parallel).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree"
                         " on (batch, seq)")
    flat_logits = logits.flatten(0, -2).float()
    flat_labels = labels.flatten()
    if isinstance(logits, DTensor) and any(isinstance(p, Shard) for p in logits.placements):
        with loss_parallel():
            return F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index)
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index)


def vocab_parallel_linear_cross_entropy(hidden, weight, labels, ignore_index=-100, **loss_kwargs):
    """Mean token cross-entropy of hidden weight^T without the logits (fastllm's fused loss).

    hidden: (..., H), plain or a DTensor (gathered to Replicate); weight: (V, H), the head or
    tied embedding: a DTensor sharded on the vocabulary (Shard(0), a tensor-parallel head) runs
    the vocabulary-parallel form (per chunk of tokens only the max, sum of exponentials, target
    logit and sum of logits cross ranks; not even the local (tokens x V/tp) logits exist); a
    plain tensor runs fastllm.ops.fused_linear_cross_entropy. loss_kwargs: reduction ("mean",
    "sum"), label_smoothing, z_loss, logit_softcap. Returns a 0-d fp32 tensor.
    """
    from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
    from fastllm.ops.vocab_parallel_cross_entropy import vocab_parallel_fused_linear_cross_entropy

    if isinstance(weight, DTensor) and tuple(weight.placements) == (Shard(0),):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(placements=[Replicate()] * len(hidden.placements))
            hidden = hidden.to_local()
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh,
                                                          weight.placements)
        return vocab_parallel_fused_linear_cross_entropy(
            hidden, weight.to_local(), labels, offset[0], weight.shape[0],
            weight.device_mesh.get_group(), ignore_index=ignore_index, **loss_kwargs)
    if isinstance(weight, DTensor):
        weight = weight.full_tensor()
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    return fused_linear_cross_entropy(hidden, weight, labels, ignore_index=ignore_index,
                                      **loss_kwargs)


def loss_backward(loss):
    """loss.backward() inside loss_parallel when the loss came from sharded logits."""
    if isinstance(loss, DTensor):
        with loss_parallel():
            loss.backward()
    else:
        loss.backward()


def causal_lm_loss(model, input_ids, labels):
    """Loss of a transformers causal LM without materialising its logits on one rank.

    input_ids, labels: (batch, seq) int64, labels already shifted (labels[:, i] is the token
    after input_ids[:, i]).
    """
    # the root forward: FSDP2 gathers the root's own parameters (embedding, head) in its hook
    return vocab_parallel_cross_entropy(model(input_ids=input_ids).logits, labels)


__all__ = ["causal_lm_loss", "loss_backward", "vocab_parallel_cross_entropy",
           "vocab_parallel_linear_cross_entropy"]

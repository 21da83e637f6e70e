"""Cross-entropy over vocabulary-parallel logits."""

import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard
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


__all__ = ["causal_lm_loss", "loss_backward", "vocab_parallel_cross_entropy"]

"""Preference optimisation (DPO and TRL DPOTrainer's pairwise losses in LOSS_TYPES; the
reference-free cpo_loss (CPO, SimPO) and orpo_loss) without logits.

A DPO step scores each prompt's chosen and rejected completion under the policy and under a
frozen reference: the sum over the completion's tokens of log p(token | what came before). The
usual code materialises the (tokens x vocab) logits for that, twice the batch's rows (chosen and
rejected) and again for the reference; here the LM head and the log-softmax are one fused pass
over chunks of tokens (fastllm.ops.fused_linear_cross_entropy with reduction "none"), so the logits
and their grad never exist:

    logps = sequence_logps(model, input_ids, labels, attention_mask)       # (2B,), chosen first
    with torch.no_grad(), fastllm.adapters.disable_adapters(model):        # LoRA: the base model
        ref = sequence_logps(model, input_ids, labels, attention_mask)     # (or a frozen copy)
    out = dpo_loss(*logps.chunk(2), *ref.chunk(2), beta=0.1)
    out.loss.mean().backward()

labels: input_ids with -100 wherever no log-probability is wanted (the prompt, the padding), as
for a causal LM's loss: position t's label is scored by the hidden state of position t - 1.

token_logps (the op) and token_logps_ref (logits materialised, log_softmax, gather) take the last
hidden states and the head's weight directly, for models this module does not know how to split.
The loss formulas are TRL's (DPOTrainer, trl 1.16; DPO's reverse-KL form, one loss type per
call: its exo_pair, discopop, aot and sft types, f-divergences, ld_alpha and WPO weighting are
not here); rewards are beta * (logps - ref_logps), detached, as TRL logs them. cpo_loss and
orpo_loss take the policy's log-probabilities alone (TRL's CPOTrainer and ORPOTrainer; their
rewards beta * logps).
"""

from typing import NamedTuple

import math

import torch
import torch.nn.functional as F
from torch import nn

from fastllm._dtensor import is_dtensor
from fastllm._hooks import user_hooked
from fastllm._modules import output_layer
from fastllm.ops.fused_linear_cross_entropy import fused_linear_cross_entropy

__all__ = ["CPO_LOSS_TYPES", "LOSS_TYPES", "DPOLoss", "cpo_loss", "dpo_loss", "orpo_log_odds",
           "orpo_loss", "sequence_logps", "token_logps", "token_logps_ref"]

_WHERE = "fastllm.preference"

# TRL's names (DPOConfig.loss_type) for the pairwise losses on sequence log-probabilities; those
# marked * take the completions' token counts (chosen_lengths, rejected_lengths)
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "bco_pair", "nca_pair", "sppo_hard",
              "apo_zero", "apo_down", "sigmoid_norm")
_NEEDS_LENGTHS = ("ipo", "sigmoid_norm")
# TRL's CPOConfig.loss_type (reference-free; simpo is SimPO), but its alphapo
CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


def token_logps(hidden, weight, labels, bias=None, ignore_index=-100, logit_softcap=None):
    """log p(labels[...]) under softmax(hidden weight^T + bias), per position, without the
    logits: fp32 (fp64 for fp64 inputs), labels' shape, 0 where labels == ignore_index.

    hidden: (..., H); weight: (V, H) (tied embeddings: the embedding matrix); labels: (...) int64
    aligned with hidden (already shifted for a causal LM). Differentiable in hidden, weight and
    bias (fused_linear_cross_entropy's reduction "none": with a frozen weight and bias the
    forward makes grad_hidden too, else the backward recomputes the logits chunk by chunk)."""
    return -fused_linear_cross_entropy(hidden, weight, labels, bias, ignore_index,
                                       reduction="none", logit_softcap=logit_softcap)


def token_logps_ref(hidden, weight, labels, bias=None, ignore_index=-100, logit_softcap=None):
    """token_logps with the logits materialised in fp32 (log_softmax and gather, as TRL's
    selective_log_softmax): the oracle."""
    logits = F.linear(hidden, weight, bias)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    return _logits_logps(logits, labels, ignore_index)


def _causal_lm(model):
    """The transformers causal LM inside `model` (a PEFT PeftModel's base model, else itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _fused_route(lm):
    """(backbone, head) when the fused path computes what the model's forward would: a causal LM
    of a family fastllm.patch knows (its logits are lm_head(hidden), no scale; Gemma 2's and 3's
    softcap, fastllm.patch.logit_softcap, is the fused path's too), a plain nn.Linear head, no
    hooks on it or on the model (they would be skipped), no DTensor head; else None (the model's
    own forward and its logits)."""
    from fastllm._patch_match import _is_causal_lm

    head = output_layer(lm)
    if (not _is_causal_lm(lm) or type(head) is not nn.Linear or user_hooked(lm)
            or user_hooked(head) or is_dtensor(head.weight)
            or (head.bias is not None and is_dtensor(head.bias))):
        return None
    return lm.model, head


def sequence_logps(model, input_ids, labels, attention_mask=None, position_ids=None,
                   average=False, ignore_index=-100, fused=True, per_token=False,
                   padding_free=False, **model_kwargs):
    """Per row, the sum (average=True: the mean) of log p(labels[t] | input_ids[:t]) over the
    positions whose label is not ignore_index: (B,) fp32 (a row with no label: 0, as TRL counts
    such a row, for the mean too). input_ids, labels: (B, T); labels as for the model's own loss
    (unshifted). per_token=True: the (B, T) log-probabilities themselves instead, column t
    scoring labels[t + 1] (0 where it is ignored, and in the last column), for sums over masks
    of one's own from one pass.

    `model`: a transformers causal LM (patched or not, with fastllm or PEFT adapters). For the
    families fastllm.patch knows (Llama, Qwen2/3, Mistral, Phi-3, Gemma 1-3) its decoder runs, then
    the head and the log-softmax fused (token_logps), so no logits exist; for other models, and
    where that split would skip something (hooks on the model or its head, a head that is not a
    plain nn.Linear, a DTensor head), and for PEFT's prompt learning, the model's forward runs
    and its logits are used instead; fused=False always takes that route (TRL's computation).

    padding_free=True (TRL DPOConfig's padding_free): the rows' attended tokens (attention_mask
    1: one span per row, left- or right-padded) run as one row without padding, each sequence's
    position ids from 0 and its attention kept inside it (transformers' packed sequences: >=
    4.57's masking_utils, or fastllm.patch's attention), the results scattered back to the rows:
    the same values, less work where the rows' lengths differ; a label is scored only where it
    and the position predicting it are both attended (so a left-padded row's first token is not,
    which padded rows would score from the padding before it). The mask is read on the host (the
    packed length); position_ids are made, not taken, and no cache is taken."""
    if input_ids.dim() != 2 or labels.shape != input_ids.shape:
        raise ValueError(f"{_WHERE}.sequence_logps: input_ids and labels must both be (batch, "
                         f"seq), got {tuple(input_ids.shape)} and {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise ValueError(f"{_WHERE}.sequence_logps: labels must be int64, got {labels.dtype}")
    lm = _causal_lm(model)
    shifted = F.pad(labels, (0, 1), value=ignore_index)[:, 1:]  # position t scores label t + 1
    kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                  **model_kwargs)
    # PEFT's prompt learning (prompt, prefix, p-tuning) feeds virtual tokens through its own
    # forward: the model's forward runs, its logits' last T positions are the input's (as TRL's)
    prompt_learning = getattr(getattr(model, "active_peft_config", None), "is_prompt_learning",
                              False)
    route = None if prompt_learning or not fused else _fused_route(lm)
    if padding_free:  # one row of every row's attended tokens; scattered back below
        # shifted: now the labels padding_free scores (both positions attended), for the mean
        flat, input_ids_p, shifted_p, kwargs, shifted = _packed(
            lm, input_ids, shifted, kwargs, prompt_learning, ignore_index)
        values = _token_values(model, lm, route, input_ids_p, shifted_p, kwargs, ignore_index)
        values = values.new_zeros(input_ids.numel()).index_copy(0, flat.to(values.device),
                                                                 values[0])
        values = values.view(input_ids.shape)
    else:
        values = _token_values(model, lm, route, input_ids, shifted, kwargs, ignore_index)
    if per_token:
        return values
    total = values.sum(-1)
    if not average:
        return total
    return total / (shifted != ignore_index).sum(-1).clamp(min=1).to(total.device)


def _token_values(model, lm, route, input_ids, shifted, kwargs, ignore_index):
    """(B, T) log-probabilities of the shifted labels: the fused route's, else the logits'."""
    if route is None:
        logits = model(input_ids=input_ids, **kwargs).logits[:, -input_ids.shape[1]:]
        return _logits_logps(logits, shifted.to(logits.device), ignore_index)
    from fastllm._patch_match import logit_softcap

    backbone, head = route
    hidden = backbone(input_ids=input_ids, **kwargs).last_hidden_state
    return token_logps(hidden.to(head.weight.device), head.weight, shifted.to(head.weight.device),
                       head.bias, ignore_index, logit_softcap(lm))


def padding_free_refusal(lm):
    """Why the causal LM `lm` cannot score rows padding-free, or None: transformers keeps the
    packed sequences apart by their position ids only for the attention implementations its
    masking_utils makes masks for (eager, sdpa, flex) and flash attention's (from the position
    ids themselves); a custom one would attend across them."""
    from transformers import masking_utils

    from fastllm._patch_match import _is_causal_lm

    if not _is_causal_lm(lm):  # (linear-attention and convolution layers ignore position ids)
        return (f"takes the families fastllm.patch knows (Llama, Qwen2/3, Mistral, Phi-3, Gemma "
                f"1-3), whose attention keeps packed sequences apart by their position ids; got "
                f"{type(lm).__name__}")
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return ("needs transformers >= 4.57 (masking_utils' packed sequences), which keeps the "
                "packed rows' attention apart")
    impl = getattr(lm.config, "_attn_implementation", None)
    if impl not in masking_utils.ALL_MASK_ATTENTION_FUNCTIONS:
        return (f"needs an attention implementation transformers keeps packed sequences apart "
                f"in ({', '.join(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS)}); got {impl!r}")
    return None


def _packed(lm, input_ids, shifted, kwargs, prompt_learning, ignore_index):
    """padding_free's (flat indices of the attended tokens (N,), input_ids (1, N), shifted
    labels (1, N), the model's kwargs with packed position ids and no attention mask, the (B, T)
    shifted labels it scores: a label where it and the position predicting it are attended)."""
    where = f"{_WHERE}.sequence_logps(padding_free=True)"
    if prompt_learning:
        raise ValueError(f"{where}: PEFT's prompt learning puts virtual tokens before each row; "
                         f"score its rows padded (padding_free=False)")
    if kwargs.get("position_ids") is not None:
        raise ValueError(f"{where}: position_ids are made from attention_mask (each row's from "
                         f"0); do not pass them")
    cached = [k for k in ("past_key_values", "cache") if kwargs.get(k) is not None]
    if cached:  # (transformers looks for packed sequences only without a cache)
        raise ValueError(f"{where}: scores without a cache; do not pass {cached[0]}")
    refusal = padding_free_refusal(lm)
    if refusal:
        raise ValueError(f"{where}: {refusal}")
    mask = kwargs.pop("attention_mask")
    if mask is None:
        keep = torch.ones_like(input_ids, dtype=torch.bool)
    else:
        if mask.shape != input_ids.shape:
            raise ValueError(f"{where}: attention_mask must be (batch, seq) like input_ids, got "
                             f"{tuple(mask.shape)}")
        keep = mask.to(input_ids.device) != 0
        spans = (keep & ~F.pad(keep, (1, 0))[:, :-1]).sum(-1)  # where a row's tokens begin
        if bool((spans > 1).any()):
            raise ValueError(f"{where}: attention_mask row {int((spans > 1).int().argmax())} "
                             f"has padding between its tokens; padding_free takes one span per "
                             f"row (left- or right-padded)")
    flat = keep.reshape(-1).nonzero().squeeze(1)
    if not len(flat):
        raise ValueError(f"{where}: attention_mask attends no token")
    position_ids = keep.long().cumsum(-1) - 1
    shifted = shifted.to(keep.device).where(keep & F.pad(keep, (0, 1))[:, 1:], ignore_index)
    kwargs = dict(kwargs, attention_mask=None,
                  position_ids=position_ids.reshape(-1)[flat][None])
    return (flat, input_ids.reshape(-1)[flat][None], shifted.reshape(-1)[flat][None], kwargs,
            shifted)


def _logits_logps(logits, labels, ignore_index):
    """token_logps_ref's last step, from logits the model made."""
    keep = labels != ignore_index
    logp = (logits if logits.dtype == torch.float64 else logits.float()).log_softmax(-1)
    return logp.gather(-1, labels.where(keep, 0).unsqueeze(-1)).squeeze(-1).where(keep, 0.0)


class DPOLoss(NamedTuple):
    """dpo_loss's result, per pair (B,): `loss` (take its mean for the step's loss, as TRL does),
    `chosen_rewards` and `rejected_rewards` (beta * (logps - ref_logps), detached)."""

    loss: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def _check_pairs(where, logps, beta, loss_type, types, label_smoothing, smoothed):
    """The checks every pairwise loss shares: loss_type among `types`, beta, label_smoothing
    (used by the `smoothed` types only) and one 1-d float per pair in each of `logps`."""
    if loss_type not in types:
        raise ValueError(f"{where}: unknown loss_type {loss_type!r}; one of {', '.join(types)}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"{where}: beta must be a finite number > 0, got {beta!r}")
    ls = label_smoothing
    if not (isinstance(ls, (int, float)) and 0.0 <= ls < 0.5) or (
            ls and loss_type not in smoothed):
        raise ValueError(f"{where}: label_smoothing must be in [0, 0.5) and is used by "
                         f"loss_type {' and '.join(map(repr, smoothed))} only, got {ls!r} with "
                         f"{loss_type!r}")
    names = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
    for name, t in zip(names, logps):
        if not torch.is_tensor(t) or not t.is_floating_point() or t.dim() != 1:
            raise ValueError(f"{where}: {name} must be a 1-d floating tensor (one value per "
                             f"pair), got {_describe(t)}")
        if t.shape != logps[0].shape:
            raise ValueError(f"{where}: {name} has {t.shape[0]} pairs, chosen_logps "
                             f"{logps[0].shape[0]}")


def _check_dpo(logps, beta, loss_type, label_smoothing, lengths):
    _check_pairs(f"{_WHERE}.dpo_loss", logps, beta, loss_type, LOSS_TYPES, label_smoothing,
                 ("sigmoid", "robust"))
    if loss_type in _NEEDS_LENGTHS:
        if any(n is None for n in lengths):
            raise ValueError(f"{_WHERE}.dpo_loss: loss_type {loss_type!r} averages over the "
                             "completions' tokens: pass chosen_lengths and rejected_lengths")
        for name, n in zip(("chosen_lengths", "rejected_lengths"), lengths):
            if not torch.is_tensor(n) or n.shape != logps[0].shape:
                raise ValueError(f"{_WHERE}.dpo_loss: {name} must be a tensor of one count "
                                 f"per pair, got {_describe(n)}")


def _describe(t):
    return (f"a {t.dim()}-d {t.dtype} tensor of shape {tuple(t.shape)}" if torch.is_tensor(t)
            else type(t).__name__)


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta=0.1,
             loss_type="sigmoid", label_smoothing=0.0, chosen_lengths=None,
             rejected_lengths=None):
    """The DPO family's per-pair loss from sequence log-probabilities (each (B,)), TRL's
    formulas. With h = beta * ((chosen - ref_chosen) - (rejected - ref_rejected)):

      sigmoid   -(1 - ls) logsigmoid(h) - ls logsigmoid(-h)   (DPO; ls > 0: conservative DPO,
                as TRL before 1.0 and Liger-Kernel have it; TRL 1.16's sigmoid takes no ls)
      hinge     relu(1 - h)                                   (SLiC)
      ipo       (d - 1 / (2 beta))^2, d = h / beta with each side's log-ratio divided by
                its completion's length
      robust    (-(1 - ls) logsigmoid(h) + ls logsigmoid(-h)) / (1 - 2 ls)
      bco_pair, nca_pair, sppo_hard, apo_zero, apo_down, sigmoid_norm: as TRL.

    ls = label_smoothing. ipo and sigmoid_norm need chosen_lengths / rejected_lengths, the
    completions' token counts (TRL divides by them; counts below 1 count as 1). Returns DPOLoss
    (loss, chosen_rewards, rejected_rewards), each (B,)."""
    logps = (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps)
    _check_dpo(logps, beta, loss_type, label_smoothing, (chosen_lengths, rejected_lengths))
    chosen_ratio = chosen_logps - ref_chosen_logps
    rejected_ratio = rejected_logps - ref_rejected_logps
    if loss_type in _NEEDS_LENGTHS:  # each side's log-ratio per completion token
        delta = (chosen_ratio / chosen_lengths.to(chosen_ratio).clamp(min=1.0)
                 - rejected_ratio / rejected_lengths.to(chosen_ratio).clamp(min=1.0))
    else:
        delta = chosen_ratio - rejected_ratio
    h, ls = beta * delta, label_smoothing
    if loss_type == "sigmoid" or loss_type == "sigmoid_norm":
        loss = -F.logsigmoid(h) * (1 - ls) - F.logsigmoid(-h) * ls
    elif loss_type == "hinge":
        loss = torch.relu(1 - h)
    elif loss_type == "ipo":
        loss = (delta - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        loss = (-(1 - ls) * F.logsigmoid(h) + ls * F.logsigmoid(-h)) / (1 - 2 * ls)
    elif loss_type == "bco_pair":
        loss = -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    elif loss_type == "nca_pair":
        c, r = beta * chosen_ratio, beta * rejected_ratio
        loss = -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r)
    elif loss_type == "sppo_hard":
        loss = (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    elif loss_type == "apo_zero":
        loss = 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    else:  # apo_down
        loss = torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(h)
    return DPOLoss(loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def cpo_loss(chosen_logps, rejected_logps, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
             simpo_gamma=0.5):
    """Reference-free pairwise loss per pair (B,), TRL's CPOTrainer (trl 1.16, experimental).
    With d = chosen_logps - rejected_logps:

      sigmoid   -(1 - ls) logsigmoid(beta d) - ls logsigmoid(-beta d)    (CPO)
      simpo     the same with d - simpo_gamma / beta                    (SimPO)
      hinge     relu(1 - beta d)
      ipo       (d - 1 / (2 beta))^2

    TRL scores ipo and simpo by each completion's mean token log-probability
    (sequence_logps(..., average=True)), the others by the sum; its step loss adds cpo_alpha x
    the chosen completions' NLL per token (SimPO: cpo_alpha = 0). Returns DPOLoss (loss,
    beta * chosen_logps, beta * rejected_logps: the rewards TRL logs, detached)."""
    where = f"{_WHERE}.cpo_loss"
    _check_pairs(where, (chosen_logps, rejected_logps), beta, loss_type, CPO_LOSS_TYPES,
                 label_smoothing, ("sigmoid", "simpo"))
    if not (isinstance(simpo_gamma, (int, float)) and math.isfinite(simpo_gamma)):
        raise ValueError(f"{where}: simpo_gamma must be a finite number, got {simpo_gamma!r}")
    d, ls = chosen_logps - rejected_logps, label_smoothing
    if loss_type == "simpo":
        d = d - simpo_gamma / beta
    if loss_type in ("sigmoid", "simpo"):
        loss = -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
    elif loss_type == "hinge":
        loss = torch.relu(1 - beta * d)
    else:  # ipo
        loss = (d - 1 / (2 * beta)) ** 2
    return DPOLoss(loss, beta * chosen_logps.detach(), beta * rejected_logps.detach())


def _log1mexp(x):
    """log(1 - exp(x)) for x <= 0, without cancellation (branch at -ln 2)."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(chosen_logps, rejected_logps, beta=0.1):
    """ORPO's odds-ratio term per pair (B,), TRL's ORPOTrainer (trl 1.16, experimental), to be
    minimised: -beta * logsigmoid(log_odds) with log_odds = (c - r) - (log(1 - e^c) -
    log(1 - e^r)), c and r the completions' mean token log-probabilities
    (sequence_logps(..., average=True), < 0). TRL's step loss is the chosen rows' NLL per token,
    over the whole row (prompt and completion), plus its mean (TRL: nll - mean(beta *
    logsigmoid(log_odds))). A mean of 0 (a completion scored certain) gives an infinite
    log-odds, and one above 0 (not a log-probability) NaN, as in TRL: not checked here, which
    would cost a device sync. Returns DPOLoss (loss, beta * c, beta * r: the rewards TRL logs,
    detached); orpo_log_odds(c, r) is the log_odds."""
    _check_pairs(f"{_WHERE}.orpo_loss", (chosen_logps, rejected_logps), beta, "sigmoid",
                 ("sigmoid",), 0.0, ())
    c, r, log_odds = _log_odds(chosen_logps, rejected_logps)
    return DPOLoss(-beta * F.logsigmoid(log_odds), beta * c.detach(), beta * r.detach())


def _log_odds(chosen_logps, rejected_logps):
    # (at least fp32, as TRL computes it: log(1 - e^x) of a bf16 mean is coarse)
    c, r = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (chosen_logps,
                                                                          rejected_logps))
    return c, r, (c - r) - (_log1mexp(c) - _log1mexp(r))


def orpo_log_odds(chosen_logps, rejected_logps):
    """ORPO's log odds ratio per pair, log(odds(c) / odds(r)) with odds(p) = p / (1 - p) of the
    completions' mean token log-probabilities (what TRL logs as log_odds_chosen)."""
    return _log_odds(chosen_logps, rejected_logps)[2]

"""What one decoder layer holds beyond its weights, for the planner's memory: the activations
autograd keeps for its backward, and LoRA's adapters."""


def activation_bytes_per_layer(model, micro_batch, seq_len, dtype_bytes=2, tp=1,
                               sequence_parallel=False, flash=True):
    """Bytes autograd keeps for one decoder layer of one micro-batch (b s tokens).

    Counted for transformers' LlamaDecoderLayer (e = dtype bytes): each RMSNorm keeps its fp32
    input, its normalised value and its output ((4 + 2e) per element) and a fp32 rsqrt per
    token; attention keeps q after rotary and its output (2e per element of heads x head_dim,
    `q_dim`: hidden in Llama, not in Qwen3), k and v (2e per kv element), and SDPA's fp32
    log-sum-exp per head; the SwiGLU MLP keeps gate, up, silu(gate) and their product (4e per
    ffn element). Qwen3's q/k norms (qk_norm) keep the fp32 copy of q and k and their
    normalised value ((4 + e) per element; their output goes to rotary, which keeps none) and
    a fp32 rsqrt per head. Without flash attention (Megatron's 2021 kernels) the scores,
    softmax and dropout mask add (2e + 1) per score element.
    """
    tokens = micro_batch * seq_len
    e = dtype_bytes
    h, t = model.hidden, tp
    norms = 2 * ((4 + 2 * e) * h + 4)
    if sequence_parallel:
        # norm inputs/outputs are sharded on the sequence; the gathered input of q/k/v and of
        # gate/up is kept whole
        norms = 2 * ((4 + e) * h / t + e * h + 4 / t)
    attn = (2 * e * model.q_dim + 2 * e * model.kv_dim + 4 * model.heads) / t
    if model.qk_norm:
        attn += ((4 + e) * (model.q_dim + model.kv_dim) + 4 * (model.heads + model.kv_heads)) / t
    mlp = ((4 if model.gated_mlp else 2) * e * model.ffn) / t
    per_token = norms + attn + mlp
    scores = 0 if flash else (2 * e + 1) * model.heads * seq_len * seq_len * micro_batch / t
    return tokens * per_token + scores


def lora_params_per_layer(model, rank):
    """Parameters of LoRA of `rank` on every linear layer of one decoder layer."""
    h, q, kv, f = model.hidden, model.q_dim, model.kv_dim, model.ffn
    # (a gated MLP's gate, up and down; else fc and proj, as GPT-2's)
    mlp = [(h, f), (h, f), (f, h)] if model.gated_mlp else [(h, f), (f, h)]
    shapes = [(h, q), (h, kv), (h, kv), (q, h)] + mlp
    return rank * sum(i + o for i, o in shapes)

"""The planner's catalogues: model shapes (ModelSpec, MODELS, a Hugging Face config.json) and
accelerators (GPUSpec, GPUS, a user's JSON)."""

import dataclasses
import json
import math
import os

GiB = 1024**3


def _is_int(value):
    # bool is an int to Python, but "num_hidden_layers": true is a slip, not a size
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# --- model shapes ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer. gated_mlp: Llama's SwiGLU (3 matrices) vs GPT's 2.

    head_dim: the width of one attention head; 0 (the default) means hidden // heads, as in
    Llama and Mistral. Qwen3 sets its own (Qwen3-0.6B: 16 heads of 128 on a hidden of 1024), so
    q and the attention output are heads x head_dim wide, not hidden (`q_dim`). qk_norm: an
    RMSNorm (head_dim weights) on each head's q and on its k, as in Qwen3.
    qkv_bias, o_bias, mlp_bias: biases on q/k/v (Qwen2; Llama's attention_bias), on o (Llama's
    attention_bias) and on gate/up/down (Llama's mlp_bias).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    tied_embeddings: bool = False
    head_dim: int = 0
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self):
        if not self.head_dim:
            try:
                rest = self.hidden % self.heads
                object.__setattr__(self, "head_dim", self.hidden // self.heads)
            except (TypeError, ZeroDivisionError):
                return  # a bad shape: `fastllm plan` checks every field and names it
            if rest and self.hidden > 0 and self.heads > 0:
                raise ValueError(f"hidden size {self.hidden} and {self.heads} heads do not divide "
                                 "and no head_dim is given")

    @property
    def q_dim(self):
        """The width of q and of the attention output (o_proj's input): heads x head_dim."""
        return self.heads * self.head_dim

    @property
    def kv_dim(self):
        return self.kv_heads * self.head_dim

    def layer_linear_params(self):
        """Weights of the matmuls in one layer (q, k, v, o, MLP); norms excluded."""
        attn = 2 * self.hidden * self.q_dim + 2 * self.hidden * self.kv_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return attn + mlp

    def layer_bias_params(self):
        """Biases of one layer's matmuls: q/k/v (q_dim + 2 kv_dim), o (hidden), the MLP's
        (gate and up: ffn each, down: hidden)."""
        mlp = self.ffn * (2 if self.gated_mlp else 1) + self.hidden
        return ((self.q_dim + 2 * self.kv_dim) * self.qkv_bias + self.hidden * self.o_bias
                + mlp * self.mlp_bias)

    def layer_params(self):
        """Matmul weights, their biases and the norms: two RMSNorms of hidden, Qwen3's q/k norms
        of head_dim."""
        return (self.layer_linear_params() + self.layer_bias_params() + 2 * self.hidden
                + (2 * self.head_dim if self.qk_norm else 0))

    def layer_tensors(self):
        """Parameter tensors in one layer (an optimizer's per-tensor work): Llama's 7 matrices
        (GPT's 6) and 2 norms, Qwen3's q/k norms, one per bias."""
        mlp = 3 if self.gated_mlp else 2
        return (4 + mlp + 2 + 2 * self.qk_norm + 3 * self.qkv_bias + self.o_bias
                + mlp * self.mlp_bias)

    def embedding_params(self):
        return self.vocab * self.hidden

    def head_params(self):
        return 0 if self.tied_embeddings else self.vocab * self.hidden

    def params(self):
        return (self.layers * self.layer_params() + self.embedding_params() + self.head_params()
                + self.hidden)


# Published shapes (each model's Hugging Face config.json).
MODELS = {
    "llama2-7b": ModelSpec("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": ModelSpec("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": ModelSpec("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": ModelSpec("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": ModelSpec("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": ModelSpec("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    "qwen3-0.6b": ModelSpec("qwen3-0.6b", 28, 1024, 16, 8, 3072, 151936, tied_embeddings=True,
                            head_dim=128, qk_norm=True),
}


# the keys a mixture-of-experts config sizes its experts by (Mixtral, Qwen2/3-MoE, DeepSeek)
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def model_from_hf_config(path_or_dict, name=None):
    """A ModelSpec from a Hugging Face config.json (Llama-style keys, or GPT-2's n_layer/n_embd)."""
    if isinstance(path_or_dict, dict):
        cfg = path_or_dict
    else:
        with open(path_or_dict) as f:
            cfg = json.load(f)
        name = name or os.path.basename(os.path.dirname(os.path.abspath(path_or_dict))) or "model"

    def get(*keys, default=None):
        for k in keys:
            if k in cfg:
                return integer(k)
        if default is None:
            raise ValueError(f"config has none of {keys}: cannot size the model")
        return default

    def integer(key):
        # (not truncated: 2.5 layers is a broken file, true is not 1)
        if cfg[key] is not None and not _is_int(cfg[key]):
            raise ValueError(f"{key} must be an integer, got {cfg[key]!r}")
        return cfg[key]

    experts = {k: cfg[k] for k in _MOE_KEYS if _is_int(cfg.get(k)) and cfg[k] > 0}
    if experts or str(cfg.get("model_type", "")).endswith("_moe"):
        said = ", ".join(f"{k}={v}" for k, v in experts.items()) or cfg["model_type"]
        raise ValueError(f"a mixture-of-experts config ({said}): fastllm plan sizes dense "
                         f"decoders only, and would leave the experts out of every estimate")
    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head")
    gated = "n_embd" not in cfg
    # biases as transformers' modelling code builds them: Qwen2 q/k/v always and no other;
    # Mistral none; Qwen3 reads attention_bias (q/k/v/o); Llama, and the families that copy
    # it, attention_bias and mlp_bias (gate/up/down)
    kind = cfg.get("model_type")
    attention_bias = bool(cfg.get("attention_bias")) and kind not in ("qwen2", "mistral")
    mlp_bias = bool(cfg.get("mlp_bias")) and kind not in ("qwen2", "qwen3", "mistral")
    return ModelSpec(
        name=name or cfg.get("model_type", "model"),
        # Qwen3 sets head_dim apart from hidden / heads; Llama writes it (equal), Qwen2 omits it
        # (0: hidden // heads)
        head_dim=("head_dim" in cfg and integer("head_dim")) or 0,
        qk_norm=kind == "qwen3",
        qkv_bias=attention_bias or kind == "qwen2",
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        layers=get("num_hidden_layers", "n_layer"),
        hidden=hidden,
        heads=heads,
        kv_heads=(heads if cfg.get("num_key_value_heads") is None
                  else integer("num_key_value_heads")),
        ffn=get("intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden,
        vocab=get("vocab_size"),
        gated_mlp=gated,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", not gated)),
    )


# --- hardware ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """One accelerator and its links. Bandwidths are per GPU, one direction, in bytes/s.

    matmul_efficiency: the fraction of peak large matmuls reach in a training step;
    comm_efficiency: the fraction of link bandwidth a ring collective reaches (bus bandwidth).
    """

    name: str
    memory: float            # bytes
    peak_flops: float        # dense bf16 (fp32 for a CPU) FLOP/s
    hbm_bandwidth: float     # bytes/s
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    matmul_efficiency: float = 0.7
    comm_efficiency: float = 0.75
    reserved: float = 2 * GiB  # context, workspaces, allocator slack
    dtype_bytes: int = 2       # training dtype of weights and activations
    latency: float = 5e-6      # seconds per collective hop
    # Host-bound costs, zero on a GPU (kernels queue asynchronously behind the host); measured
    # by measure_host() on a CPU, where every eager op is paid on the critical path:
    op_overhead: float = 0.0       # seconds of Python and dispatch per eager aten op
    dtensor_overhead: float = 0.0  # extra seconds per op on DTensors (sharding propagation)
    sync_costs: tuple = ()         # ((group size, seconds), ...): the extra wait of a blocking
    #                                collective or receive when the ranks share cores (a peer
    #                                the scheduler set aside), by the size of its group
    cores: float = 0               # cores the ranks share (measured: what other jobs leave);
    #                                0: one device per rank


# Vendor datasheets (NVIDIA A100 80GB SXM, H100 SXM5, H200 SXM): dense bf16 tensor-core FLOP/s,
# HBM bandwidth, NVLink total bandwidth halved for one direction; one InfiniBand NIC per GPU
# (HDR 200 Gb/s on DGX A100, NDR 400 Gb/s on DGX H100/H200). Memory: the total nvidia-smi
# reports (81920, 81559 and 143771 MiB), which the plan's GiB are of (80e9 bytes, the "80GB" of
# the name, is 74.5 GiB: layouts needing 74.5-79.5 GiB were refused as not fitting an H100).
_MiB = 1024**2
GPUS = {
    "A100": GPUSpec("A100-80GB", 81920 * _MiB, 312e12, 2.039e12, 300e9, 25e9),
    "H100": GPUSpec("H100-SXM", 81559 * _MiB, 989e12, 3.35e12, 450e9, 50e9),
    "H200": GPUSpec("H200-SXM", 143771 * _MiB, 989e12, 4.8e12, 450e9, 50e9),
}


_GPU_KEYS = ("name", "memory_gb", "peak_tflops", "hbm_gbps", "intra_node_gbps",
             "inter_node_gbps", "matmul_efficiency", "comm_efficiency", "reserved_gb",
             "dtype_bytes", "latency", "op_overhead", "dtensor_overhead", "sync_costs", "cores")


def _sync_costs(costs):
    """sync_costs checked: [[group size (an int >= 1), seconds (finite, >= 0)], ...]."""
    if not isinstance(costs, (list, tuple)):
        raise ValueError(f"sync_costs must be a list of [group size, seconds] pairs, got "
                         f"{costs!r}")
    for pair in costs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and _is_int(pair[0])
                and pair[0] >= 1 and _is_number(pair[1]) and math.isfinite(pair[1])
                and pair[1] >= 0):
            raise ValueError(f"sync_costs entries must be [group size (an integer >= 1), "
                             f"seconds (a finite number >= 0)], got {pair!r}")
    return tuple((n, float(t)) for n, t in costs)


def gpu_from_dict(d):
    """A user-defined GPU: keys of GPUSpec; memory in GB, peak_tflops, bandwidths in GB/s,
    latency and overheads in seconds, sync_costs [[group size, seconds], ...]. An unknown key
    is refused (a typo was a silently ignored setting), and so is a value that is not a
    number (true, "80"), a dtype_bytes that is not an integer (not truncated) and a bad
    sync_costs entry; `fastllm plan` checks the ranges."""
    unknown = sorted(k for k in d if k not in _GPU_KEYS)
    if unknown:
        raise ValueError(f"unknown GPU keys {unknown}; known: {', '.join(_GPU_KEYS)}")

    def num(key, default=None):
        value = d[key] if default is None else d.get(key, default)
        if not _is_number(value):
            raise ValueError(f"{key} must be a number, got {value!r}")
        return float(value)

    dtype_bytes = d.get("dtype_bytes", 2)
    if not _is_int(dtype_bytes):
        raise ValueError(f"dtype_bytes must be an integer (bytes per element), got "
                         f"{dtype_bytes!r}")
    return GPUSpec(
        name=d.get("name", "custom"),
        memory=num("memory_gb") * 1e9,
        peak_flops=num("peak_tflops") * 1e12,
        hbm_bandwidth=num("hbm_gbps") * 1e9,
        intra_node_bandwidth=num("intra_node_gbps") * 1e9,
        inter_node_bandwidth=num("inter_node_gbps") * 1e9,
        matmul_efficiency=num("matmul_efficiency", 0.7),
        comm_efficiency=num("comm_efficiency", 0.75),
        reserved=num("reserved_gb", 2.0) * 1e9,
        dtype_bytes=dtype_bytes,
        latency=num("latency", 5e-6),
        op_overhead=num("op_overhead", 0.0),
        dtensor_overhead=num("dtensor_overhead", 0.0),
        sync_costs=_sync_costs(d.get("sync_costs", ())),
        cores=num("cores", 0),
    )

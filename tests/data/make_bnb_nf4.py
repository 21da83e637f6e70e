"""Writes tests/data/bnb_nf4_tiny/ and bnb_nf4_tiny_skip/: a tiny Llama saved by transformers +
bitsandbytes in 4-bit NF4 (the first with double quantisation and a tied head; the second with
llm_int8_skip_modules, bf16 storage of the codes and an untied, quantised head), and beside each
<folder>_expected.safetensors: the logits bitsandbytes' own model gives for fixed input ids and
dequantised weights, which tests/test_nf4.py compares fastllm.quant.from_pretrained against
without bitsandbytes.

    PYTHONPATH=<bitsandbytes 0.50.2> python tests/data/make_bnb_nf4.py
(made once with bitsandbytes 0.50.2, transformers 5.25.0, torch 2.13.0 on CPU; not run by CI)
"""

import os
import shutil
import tempfile

import bitsandbytes.functional as bnbf
import torch
import transformers
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bnb_nf4_tiny")


def make(out, tie, **quantization):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tie, eos_token_id=[2, 7])
    with tempfile.TemporaryDirectory() as dense:
        transformers.LlamaForCausalLM(config).save_pretrained(dense)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            dense, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", **quantization))
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    ids = torch.arange(24).reshape(2, 12) * 5 % 128
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = {"input_ids": ids, "logits": logits}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        w = model.get_submodule(name).weight
        if hasattr(w, "quant_state"):
            expected[name] = bnbf.dequantize_4bit(w.data, w.quant_state, quant_type="nf4")
    save_file({k: v.contiguous() for k, v in expected.items()}, out + "_expected.safetensors")


def main():
    # nested absmax, a tied head (left dense by transformers)
    make(OUT, True, bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.float32)
    # a skip list (layer 0 dense; with one given, transformers quantises the untied head too),
    # bf16 storage of the codes, bf16 compute
    make(OUT + "_skip", False, llm_int8_skip_modules=["model.layers.0"],
         bnb_4bit_quant_storage=torch.bfloat16, bnb_4bit_compute_dtype=torch.bfloat16)


if __name__ == "__main__":
    main()

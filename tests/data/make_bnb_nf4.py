"""Writes tests/data/bnb_nf4_tiny/: a tiny Llama saved by transformers + bitsandbytes in 4-bit
NF4 with double quantisation (bnb_4bit_use_double_quant=True), and beside it
bnb_nf4_tiny_expected.safetensors: the logits bitsandbytes' own model gives for fixed input ids
and two dequantised weights, which tests/test_nf4.py compares fastllm.quant.from_pretrained
against without bitsandbytes.

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


def main():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as dense:
        transformers.LlamaForCausalLM(config).save_pretrained(dense)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            dense, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.float32))
    shutil.rmtree(OUT, ignore_errors=True)
    model.save_pretrained(OUT)
    ids = torch.arange(24).reshape(2, 12) * 5 % 128
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    expected = {"input_ids": ids, "logits": logits}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = model.get_submodule(name).weight
        expected[name] = bnbf.dequantize_4bit(w.data, w.quant_state, quant_type="nf4")
    save_file({k: v.contiguous() for k, v in expected.items()},
              OUT + "_expected.safetensors")


if __name__ == "__main__":
    main()

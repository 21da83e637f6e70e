"""Selecting and swapping a model's submodules by name, and the model inside a wrapper
(fastllm.lora, fastllm.quant)."""

import re


def matches(name, target_modules):
    # PEFT's rule: a string is a regex that must match the whole name; a list matches by suffix.
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def output_layer(model):
    """`model.get_output_embeddings()` (a transformers model's LM head), or None."""
    get_head = getattr(model, "get_output_embeddings", None)
    return get_head() if callable(get_head) else None


def replace_module(model, name, module):
    """Put `module` at the dotted `name` of `model`, in place."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def unwrap(model):
    """The module inside torch.compile's OptimizedModule and DDP / DataParallel wrappers, however
    they nest: the model whose module names PEFT's files use (a wrapper puts `_orig_mod.` or
    `module.` before each)."""
    from torch import nn
    from torch._dynamo.eval_frame import OptimizedModule

    while True:
        if isinstance(model, OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model

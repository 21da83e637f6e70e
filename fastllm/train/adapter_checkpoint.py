"""A LoRA/DoRA/prefix run's checkpoint: its adapter in PEFT's folder layout, the same files from
every layout. Sharded trainable parameters (FSDP2, tensor parallel) are gathered whole before
rank 0 writes them and loaded whole on every rank before each keeps its shards; a pipeline
writes the whole model's adapter from its stages' gathered tensors and each stage loads its
layers from it (fastllm.train.checkpoint_layout re-exports save_adapter, load_adapter and
adapter_layout)."""

import contextlib
import os
from types import SimpleNamespace

import torch

__all__ = ["save_adapter", "load_adapter", "adapter_layout"]


def save_adapter(module, path, backend, model_state=None, stages=None):
    """A LoRA/DoRA/prefix run's checkpoint holds the adapter only (PEFT's folder layout).
    Sharded trainable parameters (FSDP2, tensor parallel) are written from model_state, the
    gathered full tensors (full_state(..., trainable_only=True), on rank 0). stages: a
    pipeline's adapter_layout (rank 0's stage holds some of the layers): the adapter is written
    from model_state, every stage's gathered tensors."""
    if stages is not None:
        _save_stages(path, model_state, *stages)
        return
    with _whole_trainable(module, model_state):
        if backend == "torch":
            module.save_pretrained(path)
            return
        from fastllm.adapters import save_adapter as save

        save(module, path, task_type="CAUSAL_LM")


def load_adapter(module, path, backend, stages=None):
    """Load a LoRA/DoRA/prefix checkpoint's adapter on every rank. Sharded trainable parameters
    are loaded whole (the loaders' checks unchanged), then each rank keeps its shards. stages:
    a pipeline's adapter_layout (each stage loads its layers' tensors)."""
    from torch.distributed.tensor import distribute_tensor

    sharded = _sharded_trainable(module)
    whole = {name: p.full_tensor() for name, p in sharded}  # (collective: every rank)
    with _whole_trainable(module, whole):
        if stages is not None:
            _load_stage(module, path, *stages)
        elif backend == "torch":
            import peft
            from safetensors.torch import load_file

            peft.set_peft_model_state_dict(
                module, load_file(os.path.join(path, "adapter_model.safetensors")))
        else:
            from fastllm.adapters import load_adapter as load

            load(module, path)
        loaded = {name: p.detach() for name, p in module.named_parameters()
                  if name in whole}
    with torch.no_grad():
        for name, p in sharded:  # (the same order on every rank: scattered from rank 0)
            p.copy_(distribute_tensor(loaded[name], p.device_mesh, p.placements))


def adapter_layout(model):
    """(adapter_config.json's contents, {parameter name: PEFT key}, every layer's settings and
    every key's shape) of a LoRA/DoRA model, taken whole before a pipeline cuts it into stages:
    a pipeline writes the files one process writes (fastllm.lora.save_adapter's), and every
    stage checks a resumed adapter against the whole model, so that all refuse it or none."""
    from fastllm.lora import _adapter_config, lora_modules, peft_keys

    layers = lora_modules(model)
    by_name = dict(layers)
    keys = {f"{name}.{attr}": key for name, attr, key in peft_keys(layers)}
    shapes = {key: tuple(getattr(by_name[name], attr).shape)
              for name, attr, key in peft_keys(layers)}
    settings = [(name, SimpleNamespace(r=layer.r, alpha=layer.alpha, dropout=layer.dropout,
                                       use_rslora=layer.use_rslora)) for name, layer in layers]
    return _adapter_config(model, layers, "CAUSAL_LM"), keys, (settings, shapes)


def _save_stages(path, model_state, config, keys, _whole):
    from fastllm.adapter_files import write_adapter

    missing = sorted(n for n in keys if n not in model_state)
    if missing:
        raise ValueError(f"fastllm train: the pipeline's gathered state lacks the adapter "
                         f"tensors {missing[:3]}")
    write_adapter(path, config, {key: model_state[n].detach().cpu().contiguous()
                                 for n, key in keys.items()})


def _load_stage(stage, path, config, keys, whole):
    """Load this pipeline stage's layers from the whole model's adapter in `path`: the adapter
    must hold exactly the whole model's keys (`keys`, of adapter_layout), be LoRA or DoRA as the
    model's is (`config`), and its settings and shapes agree with every layer's (`whole`;
    fastllm.lora's load_adapter checks), on every stage alike. A stage may hold no adapted
    layer."""
    from fastllm.lora import (_PEFT_PREFIX, _check_layers_agree, _check_supported, _load_state,
                              lora_modules, read_config, read_weights)

    settings = _check_supported(read_config(path))
    if bool(settings["use_dora"]) != bool(config["use_dora"]):
        kinds = {True: "a DoRA", False: "a LoRA"}
        raise ValueError(f"fastllm train: {path} holds {kinds[bool(settings['use_dora'])]} "
                         f"adapter, this run trains {kinds[bool(config['use_dora'])]} one")
    layers = lora_modules(stage)
    state = read_weights(path)
    want = set(keys.values())
    if state.keys() != want:
        raise ValueError(f"fastllm train: {path} does not hold this model's adapter: missing "
                         f"{sorted(want - state.keys())[:3]}, unexpected "
                         f"{sorted(state.keys() - want)[:3]}")
    every_layer, shapes = whole
    _check_layers_agree(every_layer, settings)
    for key, shape in shapes.items():
        if tuple(state[key].shape) != shape:
            raise ValueError(f"fastllm.lora.load_adapter: {key[len(_PEFT_PREFIX):]} is {shape} "
                             f"in the model, {tuple(state[key].shape)} in the adapter")
    prefixes = tuple(f"{_PEFT_PREFIX}{name}." for name, _ in layers)
    _load_state(stage, {k: v for k, v in state.items() if k.startswith(prefixes)})


def _sharded_trainable(module):
    from torch.distributed.tensor import DTensor

    return [(n, p) for n, p in module.named_parameters()
            if p.requires_grad and isinstance(p, DTensor)]


@contextlib.contextmanager
def _whole_trainable(module, whole):
    """Within it, the module's trainable DTensor parameters are plain Parameters holding
    whole[name] (their full tensors), so that the adapter code reads and writes whole tensors;
    the DTensors are put back after, whatever happens. No DTensor: nothing changes."""
    sharded = dict(_sharded_trainable(module))
    if not sharded:
        yield
        return
    missing = sorted(set(sharded) - set(whole or ()))
    if missing:
        raise ValueError(f"fastllm train: no full tensor for the sharded parameters "
                         f"{missing[:3]} to save the adapter from")
    swapped, hooks = [], {}
    try:
        for name, p in sharded.items():
            owner, _, leaf = name.rpartition(".")
            mod = module.get_submodule(owner)
            # FSDP2's load_state_dict post-hooks re-shard the owner's params: a plain one
            # loaded by the adapter code (fastllm.load_prefix) is not theirs to re-shard
            if mod not in hooks:
                hooks[mod] = mod._load_state_dict_post_hooks
                mod._load_state_dict_post_hooks = type(hooks[mod])()
            full = whole[name].to(p.device_mesh.device_type)
            mod._parameters[leaf] = torch.nn.Parameter(full, requires_grad=True)
            swapped.append((mod, leaf, p))
        yield
    finally:
        for mod, leaf, p in swapped:
            mod._parameters[leaf] = p
        for mod, saved in hooks.items():
            mod._load_state_dict_post_hooks = saved

"""One entry point for every PEFT adapter format fastllm trains: LoRA, DoRA (LoRA's files with
use_dora) and prefix-tuning (PREFIX_TUNING).

    load_adapter(model, "adapter/")      # whichever the folder's adapter_config.json says
    save_adapter(model, "adapter/")      # whichever the model carries
    with disable_adapters(model): ...    # the base model (PEFT's disable_adapter), LoRA/DoRA
"""

__all__ = ["load_adapter", "save_adapter", "adapter_kind", "disable_adapters"]


def adapter_kind(path):
    """'lora', 'dora' or 'prefix' from a folder's adapter_config.json."""
    from fastllm.lora import read_config

    config = read_config(path)
    if config.get("peft_type", "LORA") == "PREFIX_TUNING":
        return "prefix"
    return "dora" if config.get("use_dora") else "lora"


def load_adapter(model, path, adapter_dtype=None):
    """Load the adapter in `path` into a transformers model (fastllm's modules). Returns it.
    adapter_dtype: for LoRA/DoRA layers it creates (fastllm.lora.inject_lora's)."""
    kind = adapter_kind(path)
    if kind == "prefix":
        from fastllm._modules import unwrap
        from fastllm.prefix import load_prefix

        load_prefix(unwrap(model), path)  # (a torch.compile'd or DDP model: the one inside)
        return model
    if kind == "dora":
        from fastllm.dora import load_adapter as load_dora

        return load_dora(model, path, adapter_dtype=adapter_dtype)
    from fastllm.lora import load_adapter as load_lora

    return load_lora(model, path, adapter_dtype=adapter_dtype)


def save_adapter(model, path, task_type="CAUSAL_LM"):
    """Write the model's adapter (prefix, else LoRA/DoRA layers) in PEFT's format. A model
    carrying both is refused (save_prefix and fastllm.lora.save_adapter refuse it), nothing
    written: PEFT has no single adapter file holding both. A torch.compile'd or DDP model: the
    model inside's."""
    from fastllm._modules import unwrap

    model = unwrap(model)
    if hasattr(model, "_fastllm_prefix"):
        from fastllm.prefix import save_prefix

        return save_prefix(model, path, task_type=task_type)
    from fastllm.lora import save_adapter as save_lora

    return save_lora(model, path, task_type=task_type)


def disable_adapters(model):
    """A context in which the model's LoRA/DoRA layers compute their base layers alone
    (fastllm.lora.disable_adapters; a PEFT model: its own disable_adapter()). A prefix is
    refused: its hook feeds every call."""
    peft_off = getattr(model, "disable_adapter", None)
    if callable(peft_off):
        return peft_off()
    if hasattr(model, "_fastllm_prefix"):
        raise ValueError("fastllm.adapters.disable_adapters: the model carries a prefix "
                         "(fastllm.prefix), which cannot be switched off for a call; use a "
                         "frozen copy of the model without it as the reference")
    from fastllm.lora import disable_adapters as disable_lora

    return disable_lora(model)

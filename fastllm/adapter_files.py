"""Reading a PEFT adapter folder's two files (adapter_config.json, adapter_model.safetensors)
for fastllm.lora, fastllm.dora and fastllm.prefix: a truncated, corrupt or ill-typed file is a
ValueError naming the file (and the key), raised before any model changes."""

import json
import os
import re

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# What an adapter tensor may be: real floating dtypes torch computes in (a copy_ into a float
# parameter would silently cast an int, bool, complex or float8 tensor)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def write_adapter(path, config, tensors):
    """adapter_config.json (`config`) and adapter_model.safetensors (`tensors`, PEFT's keys) in
    `path`, replacing what was there only once both are written."""
    from safetensors.torch import save_file

    from fastllm._files import json_writer, write_replacing

    write_replacing(path, {
        ADAPTER_WEIGHTS: lambda f: save_file(tensors, f, metadata={"format": "pt"}),
        ADAPTER_CONFIG: json_writer(config)})


def read_config(path):
    """A folder's adapter_config.json as a dict. A truncated or corrupt file, or JSON that is
    not an object, raises ValueError naming the file (json's own error names neither)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    try:
        with open(file) as f:
            config = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"fastllm.lora.load_adapter: {file} is not valid JSON (truncated or "
                         f"corrupt?): {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"fastllm.lora.load_adapter: {file} holds a JSON {type(config).__name__}, "
                         f"not an object of PEFT's settings")
    return config


def read_weights(path, name=ADAPTER_WEIGHTS, where="fastllm.lora.load_adapter"):
    """A folder's adapter_model.safetensors (or `name`) as {key: tensor}; a truncated or corrupt
    file, or a tensor of a dtype but FLOAT_DTYPES, raises ValueError naming it (safetensors' own
    error does not)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, name)
    legacy = os.path.join(path, name.removesuffix(".safetensors") + ".bin")
    if not os.path.exists(file) and name.endswith(".safetensors") and os.path.isfile(legacy):
        tensors = _read_legacy(legacy, where)  # PEFT's safe_serialization=False (older PEFT)
    else:
        try:
            tensors = load_file(file)
        except SafetensorError as e:
            raise ValueError(f"{where}: {file} is not a valid safetensors file "
                             f"(truncated or corrupt?): {e}") from None
    for key, tensor in tensors.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{where}: {file} holds {key} as {tensor.dtype}; adapter tensors "
                             f"must be float16, bfloat16, float32 or float64")
    return tensors


def _read_legacy(file, where):
    """An adapter_model.bin (torch.save of {key: tensor}), read with weights_only=True: tensors
    and containers only, nothing unpickled that could run code."""
    import pickle

    try:
        tensors = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"{where}: {file} is not a PyTorch state dict of tensors (truncated, "
                         f"corrupt, or holding other objects?): {' '.join(str(e).split())[:300]}"
                         ) from None
    if not isinstance(tensors, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items()):
        raise ValueError(f"{where}: {file} is not a dict of named tensors")
    return tensors


# adapter_config.json, field by field, against PEFT 0.22.0's LoraConfig and PeftConfig (a
# newer PEFT's fields are refused when set: check_lora_config).
PEFT_CLASSIFIED = "0.22.0"
# Read by fastllm, with PEFT's default for a field the file leaves out:
_READ = {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "lora_dropout": 0.0, "use_rslora": False,
         "target_modules": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
         "init_lora_weights": True}
# No effect on what a loaded adapter computes: metadata; the settings of an init method (the
# method itself is checked); options read only beside an option refused below; and
# ensure_weight_tying, whose only effect (adapters on tied embeddings) is in the weights, which
# _load_state refuses.
_IGNORED = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
            "inference_mode", "runtime_config", "loftq_config", "eva_config", "corda_config",
            "lora_ga_config", "astra_config", "megatron_core", "qalora_group_size",
            "ensure_weight_tying"}
# Not implemented by fastllm: refused unless at PEFT's default, with what each one does.
_REFUSED = {
    "exclude_modules": (None, "leaves matching modules out"),
    "fan_in_fan_out": (False, "stores the weights transposed (Conv1D)"),
    "bias": ("none", "trains the biases"),
    "modules_to_save": (None, "saves whole modules beside the adapter"),
    "layers_to_transform": (None, "adapts only some layers"),
    "layers_pattern": (None, "adapts only some layers"),
    "megatron_config": (None, "adapts Megatron's parallel layers"),
    "trainable_token_indices": (None, "trains some embedding rows"),
    "velora_config": (None, "changes the adapter's backward (VeLoRA)"),
    "alora_invocation_tokens": (None, "applies the adapter only after the invocation tokens "
                                      "(activated LoRA)"),
    "use_qalora": (False, "pools the adapter's input (QALoRA)"),
    "monteclora_config": (None, "samples the adapter (MonteCLoRA)"),
    "layer_replication": (None, "repeats base layers"),
    "lora_bias": (False, "adds a bias to lora_B"),
    "target_parameters": (None, "adapts parameters, not modules"),
    "use_bdlora": (None, "makes A or B block-diagonal (BD-LoRA)"),
    "arrow_config": (None, "routes between adapters (Arrow)"),
    "kasa_config": (None, "truncates the base weight's SVD (KaSA)"),
}
# init_lora_weights: the values that only draw A and B, which the saved tensors then replace
# (nora: A's columns normalised, B zero); and those that also rewrite the base weight
# (W - scaling B0 A0, or a quantised W), which PEFT redoes whenever it loads the adapter (astra:
# W projected onto its output activations' eigenvectors, PEFT 0.22).
_PLAIN_INITS = ("gaussian", "orthogonal", "mica", "eva", "nora")
_BASE_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga", "astra")


def _empty(value):
    return value is None or value is False or (isinstance(value, (str, list, dict)) and not value)


def check_lora_config(config):
    """Refuse, naming the field and its value, an adapter_config.json fastllm would load into
    something else than PEFT computes; return the LoRA settings it reads.

    Every field of PEFT's LoraConfig is read (_READ), or has no effect on the loaded adapter's
    computation (_IGNORED), or is refused unless at PEFT's default (_REFUSED). init_lora_weights
    may be True, False or one of _PLAIN_INITS (mica trains only A in PEFT: here B trains too).
    A field fastllm does not know (a newer PEFT's) is refused unless its value is None, False or
    empty: new PEFT options are off that way, and on may change what the adapter computes.
    r and lora_alpha default to PEFT's 8; target_modules must name the modules (PEFT's default
    for a missing one, per architecture, is not fastllm's to guess).
    """
    where = "fastllm.lora.load_adapter: adapter_config.json has"
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"fastllm.lora.load_adapter: not a LoRA adapter "
                         f"({config.get('peft_type')})")
    for key, value in config.items():
        if key in _READ or key in _IGNORED:
            continue
        if key in _REFUSED:
            default, does = _REFUSED[key]
            if value != default and not _empty(value):
                raise ValueError(f"{where} {key}={value!r}, which {does}; fastllm does not "
                                 "support it")
        elif not _empty(value):
            raise ValueError(f"{where} {key}={value!r}, a field fastllm does not know (a newer "
                             "PEFT's?); it may change what the adapter computes, so it is refused")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_INITS):
        raise ValueError(
            f"{where} init_lora_weights={init!r}, which moves part of the base weights into the "
            "adapter; PEFT redoes that on loading, fastllm does not. Save it from PEFT with "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...) for a plain LoRA "
            "adapter")
    if not (isinstance(init, bool) or (isinstance(init, str) and init.lower() in _PLAIN_INITS)):
        raise ValueError(f"{where} init_lora_weights={init!r}, an initialisation fastllm does "
                         "not know; it may change the base weights, so it is refused")
    targets = config.get("target_modules")
    if targets is None:
        raise ValueError(f"{where} no target_modules; name the adapted modules (PEFT would take "
                         "its default for the architecture, which fastllm does not know)")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        raise ValueError(f"{where} target_modules='all-linear', PEFT's shorthand, which it expands "
                         "when it creates an adapter; list the module names instead")
    flags = {field: config[field] for field in ("use_rslora", "use_dora")
             if config.get(field) is not None}
    check_lora_settings(where, targets, config.get("rank_pattern"), config.get("alpha_pattern"),
                        **flags)
    get = {key: config.get(key) for key in _READ}
    return {key: _READ[key] if value is None else value for key, value in get.items()}


def check_lora_settings(where, target_modules, rank_pattern=None, alpha_pattern=None, **flags):
    """Refuse, naming the argument, settings fastllm.lora would misread: target_modules neither
    a string (compiled here as the regex it is) nor a list/tuple/set of strings; a flag (use_rslora,
    use_dora) but a bool (bool("false") is True); rank_pattern / alpha_pattern neither None nor a
    dict whose keys are strings that compile as fastllm.lora._pattern_value uses them. `where`
    starts each message (e.g. "fastllm.lora.inject_lora:"). The same checks for an
    adapter_config.json (check_lora_config) and for inject_lora's arguments."""
    if not (isinstance(target_modules, str) or (
            isinstance(target_modules, (list, tuple, set, frozenset))
            and all(isinstance(t, str) for t in target_modules))):
        raise ValueError(f"{where} target_modules={target_modules!r}; need a regex or a list of "
                         "names")
    for field, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{where} {field}={value!r}; need true or false (a bool)")
    if isinstance(target_modules, str):
        _check_regex(where, "target_modules", target_modules, target_modules)
    for field, pattern in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        if pattern is not None and not isinstance(pattern, dict):
            raise ValueError(f"{where} {field}={pattern!r}; need an object (a dict) mapping "
                             "module-name regexes to values, as PEFT writes it")
        for key in pattern or {}:
            if not isinstance(key, str):
                raise ValueError(f"{where} {field} key {key!r}; keys are module-name regexes "
                                 "(strings)")
            _check_regex(where, f"{field} key", key, rf"(.*\.)?({key})$")


def _check_regex(where, field, value, regex):
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"{where} {field} {value!r}, which is not a valid regex: {e}") from None

"""Config values from the command line or YAML: each `key=value` converted to its field's type
(fastllm/train/config.py's dataclasses), with an error naming the key for anything else."""

import dataclasses
import typing


class ConfigError(ValueError):
    """A config value is unknown, mistyped or inconsistent."""


# list keys whose items are free text: an unbracketed value is one item, not split at commas
# (a list of several is given as a YAML list: eval.prompts='["a, b", "c"]')
FREE_TEXT_LISTS = ("eval.prompts",)


def field_names(obj):
    return [f.name for f in dataclasses.fields(obj)]


def field_type(obj, name):
    hints = typing.get_type_hints(type(obj))
    return hints[name]


def parse_free(text):
    import yaml

    if not isinstance(text, str):
        return text
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def convert(key, value, current, hint):
    """`value` (a string from the command line or a YAML scalar) as the type of the field."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union and type(None) in args:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        # an empty string stays a (refused) empty path for Optional[str]: `data.path=` must
        # not silently mean the built-in corpus
        empty = () if inner is str else ("",)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null") + empty):
            return None
        hint = inner
        origin, args = typing.get_origin(hint), typing.get_args(hint)
    try:
        if hint is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if hint is int:
            # an exponent is a whole number or refused: 5e-1 is not 0, 1e400 not a traceback
            number = float(value) if isinstance(value, str) and "e" in value.lower() else value
            if isinstance(number, bool) or (isinstance(number, float) and not number.is_integer()):
                raise ValueError(value)
            return int(number)
        if hint is float:
            if isinstance(value, bool):  # YAML's yes/true: not 1.0
                raise ValueError(value)
            return float(value)
        if hint is str:
            if value is None or isinstance(value, (list, tuple, dict)):  # not "None", "['a']"
                raise ValueError(value)
            return str(value)
        if origin in (list, typing.List):
            items = value
            if isinstance(value, str) and value.strip().startswith("["):
                items = parse_free(value)
            elif isinstance(value, str) and key in FREE_TEXT_LISTS:
                items = [value] if value.strip() else []  # a prompt may hold commas: one item
            elif isinstance(value, str):
                items = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(items, (list, tuple)):
                items = [items]
            inner = args[0] if args else str
            return [convert(key, v, None, inner) for v in items]
        if origin in (dict, typing.Dict):
            data = parse_free(value) if isinstance(value, str) else value
            if not isinstance(data, dict):
                raise ValueError(value)
            return dict(data)
    except (ValueError, TypeError):
        pass
    else:
        if dataclasses.is_dataclass(current):
            data = parse_free(value) if isinstance(value, str) else value
            if not isinstance(data, dict):
                raise ConfigError(f"fastllm train: {key} is a section: set its keys ({key}."
                                  f"<name>=...) or give a mapping, got {value!r}")
            update(current, data, key + ".")
            return current
        return value
    raise ConfigError(f"fastllm train: {key}={value!r} is not a valid {_type_name(hint)}")


def _type_name(hint):
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def update(obj, data, prefix):
    if not isinstance(data, dict):
        raise ConfigError(f"fastllm train: {prefix.rstrip('.') or 'config'} must be a mapping")
    for key, value in data.items():
        if key not in field_names(obj):
            raise ConfigError(f"fastllm train: unknown config key {prefix + key!r}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            update(current, value, prefix + key + ".")
        else:
            setattr(obj, key, convert(prefix + key, value, current, field_type(obj, key)))


def consumed(config_class, key, value):
    """Whether constructing config_class (an HF config) takes the keyword `key` into other fields
    (transformers 5's LlamaConfig moves rope_theta, partial_rotary_factor and rope_scaling into
    rope_parameters); a keyword it does not know it keeps as an attribute of that name (a typo)."""
    try:
        return key not in config_class(**{key: value}).to_dict()
    except Exception:  # it read the value and refused it: fastllm.train.model.check_model says why
        return True


def validate_quantize_base(cfg, need):
    """lora.quantize_base: none, or nf4 (QLoRA: fastllm.quant.quantize_nf4 before the adapters)
    where the 4-bit layers can run: fastllm's LoRA, whole on each rank or FSDP2-sharded."""
    value = cfg.lora.quantize_base
    need(value in ("none", "nf4"), f"lora.quantize_base must be none or nf4, got {value!r}")
    need(value == "nf4" or not cfg.lora.double_quant,
         "lora.double_quant=true double-quantises the absmax of a 4-bit base: it needs "
         "lora.quantize_base=nf4")
    if value == "none":
        return
    need(cfg.finetune == "lora" and cfg.backend == "fastllm",
         f"lora.quantize_base=nf4 is QLoRA (or QDoRA with lora.use_dora): finetune=lora with "
         f"backend=fastllm, got finetune={cfg.finetune} backend={cfg.backend}")
    par = cfg.parallel
    # (FSDP2 shards the 4-bit codes on dim 0 with their decoder layer and gathers them whole
    # for its forward; tensor parallel would need them split by rows or columns, ZeRO shards
    # only what trains)
    need(par.strategy in ("auto", "none", "ddp", "fsdp") and par.tp == 1 and par.pp == 1,
         f"lora.quantize_base=nf4 runs whole on each rank or FSDP2-sharded: parallel.strategy "
         f"none/ddp/fsdp/auto with parallel.tp=pp=1, got strategy={par.strategy} tp={par.tp} "
         f"pp={par.pp}")
    if par.strategy == "fsdp":  # (before the model loads; apply_fsdp refuses it too)
        from fastllm.parallel import _torch_support

        why = _torch_support.fsdp2_integer_params_refusal("lora.quantize_base=nf4")
        need(why is None, why)

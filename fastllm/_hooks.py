"""Whether calling a module runs more than its forward: fastllm.patch and the LoRA layers read a
module's weights around the call (a fused op in its place) only where nothing else would run.

An accelerate hook (device_map dispatch, cpu_offload) may move or load the weights; a user's
forward hook or pre-hook of the module, or a global one, would be skipped (one capturing a
projection's output got nothing; a steering hook on an adapted layer's base layer ran only once
the adapter was merged, so merging changed the model's output). torch.distributed's own hooks
(FSDP2's unshard, tensor parallel's redistribution) are not a user's: the callers read such a
module's DTensor weights as they are."""

from torch.nn.modules import module as nn_module


def hooked(module):
    """Whether calling `module` (or, for a LoRA layer, its base layer) runs more than its forward:
    such a module is called, its weights never read around the call."""
    if user_hooked(module):
        return True
    # (a LoRA layer's base layer is a submodule: read from _modules, without getattr's
    # AttributeError through nn.Module.__getattr__ for every other module, 1.5 us a call)
    base = module._modules.get("base_layer")
    if base is None:
        base = module.__dict__.get("base_layer")
    return base is not None and user_hooked(base)


def user_hooked(module, offload_only=False):
    """Whether `module(x)` runs a hook that reading its weights around the call would skip.
    offload_only: an accelerate hook counts only where it may move the weights (offloading, or
    a hook of unknown kind), not the device alignment a multi-device dispatch puts on every
    layer (the LoRA layers keep their fused op under it: their weights are where they are)."""
    # (each dict tested for emptiness first: the common case, without a call) A backward hook
    # counts too: it fires only where the module itself is called.
    for hooks in (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
                  nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks):
        if hooks and _users(hooks):
            return True
    hf = module.__dict__.get("_hf_hook")
    if hf is not None and (not offload_only or _moves_weights(hf)):
        return True
    for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                 "_backward_pre_hooks"):
        hooks = module.__dict__.get(name)
        if hooks and _users(hooks):
            return True
    return False


def _moves_weights(hook):
    """Whether an accelerate hook may put the module's weights elsewhere for the call."""
    chain = getattr(hook, "hooks", None)  # (accelerate's SequentialHook)
    if chain is not None:
        return any(_moves_weights(h) for h in chain)
    if type(hook).__name__ == "AlignDevicesHook":
        return bool(getattr(hook, "offload", True))
    return True


def _users(hooks):
    """Whether a hook dict holds a hook that is not torch.distributed's."""
    for hook in hooks.values():
        fn = getattr(hook, "func", hook)  # (a functools.partial)
        fn = getattr(fn, "__func__", fn)  # (a bound method)
        if not getattr(fn, "__module__", "").startswith("torch.distributed."):
            return True
    return False

"""Whether calling a module runs more than its forward: fastllm.patch and the LoRA layers read a
module's weights around the call (a fused op in its place) only where nothing else would run.

An accelerate hook (device_map dispatch, cpu_offload) may move or load the weights; a user's
forward hook or pre-hook of the module, or a global one, would be skipped (one capturing a
projection's output got nothing; a steering hook on an adapted layer's base layer ran only once
the adapter was merged, so merging changed the model's output). torch.distributed's own hooks
(FSDP2's unshard, tensor parallel's redistribution) are not a user's: the callers read such a
module's DTensor weights as they are."""

from torch.nn.modules import module as nn_module


def user_hooked(module):
    """Whether `module(x)` runs a hook that reading its weights around the call would skip."""
    if _users(nn_module._global_forward_hooks) or _users(nn_module._global_forward_pre_hooks):
        return True
    return ("_hf_hook" in module.__dict__ or _users(module._forward_hooks)
            or _users(module._forward_pre_hooks))


def _users(hooks):
    """Whether a hook dict holds a hook that is not torch.distributed's."""
    for hook in hooks.values():
        fn = getattr(hook, "func", hook)  # (a functools.partial)
        fn = getattr(fn, "__func__", fn)  # (a bound method)
        if not getattr(fn, "__module__", "").startswith("torch.distributed."):
            return True
    return False

"""fp32 master weights kept in step with their params (fastllm.optim.AdamW's master_weights,
GaLoreAdamW's): what tells a write to a param from outside the optimizer (model.load_state_dict,
an in-place clip, `p.data = w`), so that the next step re-syncs the master from it instead of
writing a stale master back over the change."""

import torch

from fastllm._dtensor import local
from fastllm.optim._hyper import slot_name


def written_version(p):
    """What tells a write to p from outside the optimizer: its version counter (in-place writes,
    model.load_state_dict) and its memory (`p.data = w`, vector_to_parameters). In-place writes
    through `p.data` bypass the version counter, as they bypass autograd, and are not seen
    unless the user then calls torch.autograd.graph.increment_version(p) (AdamW's docstring).
    (The memory is not recorded in a step traced by torch.compile, which has no addresses.)
    Nor is a `p.data = w` seen whose new memory the allocator placed at the freed old address
    (`m.float(); ...; m.bfloat16()` can): increment_version(p) after such a round trip too."""
    if torch.compiler.is_compiling():
        return p._version, None
    return p._version, local(p).data_ptr()


def versions_in_sync(versions):
    """For a pickled or deep-copied optimizer, whose params will be new tensors (other version
    counters and memory): param -> whether its master is in sync with it, from
    {param: written_version right after the optimizer last wrote it}."""
    return {p: written_version(p) == version for p, version in versions.items()}


def versions_after_copy(in_sync):
    """versions_in_sync's answer, on the copy, as {param: written_version}: the current one for
    a master in sync, (-1, None), which no param has, for one to re-sync at the next step."""
    return {p: written_version(p) if fresh else (-1, None) for p, fresh in in_sync.items()}


def written_versions(call):
    """written_version of each param of the call (without a call per param: the host cost of a
    step is a few microseconds per tensor)."""
    if torch.compiler.is_compiling() or not call.fast:  # (fast calls hold no DTensor)
        return list(map(written_version, call.params))
    return [(p._version, p.data_ptr()) for p in call.params]


def stale_masters(call):
    """The indices of the call's params written outside the optimizer since its own last write
    (model.load_state_dict, an in-place clip, `p.data = w`, ...)."""
    if None not in call.versions and written_versions(call) == call.versions:
        return []  # the common case: nothing wrote a param since the last step
    compiling = torch.compiler.is_compiling()
    return [i for i, (p, version) in enumerate(zip(call.params, call.versions))
            if version is not None and (
                p._version != version[0] or (not compiling and version[1] is not None
                                             and local(p).data_ptr() != version[1]))]


def refuse_stale_masters_in_capture(opt, plan):
    """Before a step changes anything: inside a CUDA graph capture a master re-sync would be
    captured and replayed every step, each replay replacing the fp32 master with the bf16 param
    (its precision lost; seen on an H200, 2026-12-04), so a stale master is refused there."""
    if (torch.compiler.is_compiling() or not torch.cuda.is_available()
            or not torch.cuda.is_current_stream_capturing()):
        return
    for call in (c for calls in plan.groups for c in calls if c.kind == "master"):
        stale = stale_masters(call)
        if stale:
            name = slot_name(opt, call.slots[stale[0]], call.params[stale[0]])
            raise RuntimeError(
                f"fastllm.optim.AdamW: {name} was written outside the optimizer since its last "
                f"step, and its fp32 master cannot be re-synced inside a CUDA graph capture (the "
                f"copy would be replayed every step); take one step eagerly after such a write, "
                f"or load the optimizer's state (load_state_dict: the loaded master is the "
                f"truth), before capturing")


def resync_masters(opt, call):
    """Re-sync the fp32 master from its param if something outside the optimizer wrote the
    param since the optimizer's own last write: otherwise this step would write the stale
    master back over that change."""
    for i in stale_masters(call):
        p = call.params[i]
        opt.state[p]["master_param"].copy_(local(p).detach())

"""Refused loads change nothing: DistributedOptimizer.load_state_dict / load_sharded_state_dict
and PowerSGD.load_state_dict check a whole state before installing any of it, and the error
names the parameter (or bucket) and the key. In one process, on a world-1 Gloo group: one bucket
per param (a tiny bucket_cap_mb), param 0 in the last bucket, so that a bad entry for it comes
after every other bucket; a load that installs as it goes would have changed those first."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from fastllm.distributed import DistributedOptimizer, PowerSGD


@pytest.fixture(scope="module", autouse=True)
def world1(tmp_path_factory):
    """The default process group, world 1 (one made here unless one already exists)."""
    if dist.is_initialized():
        yield
        return
    store = os.path.join(str(tmp_path_factory.mktemp("pg")), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _trained(steps, seed):
    """A model and its DistributedOptimizer after `steps` steps on data drawn from `seed`."""
    model = _model()
    opt = DistributedOptimizer(model, stage=2, lr=1e-2, bucket_cap_mb=1e-4, max_grad_norm=1.0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
    opt.finish_param_sync()
    return model, opt


def _same(a, b):
    """Equal, tensors bit for bit (dtype and shape included), containers recursively."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b


def _snapshot(model, opt):
    inner = [opt.optimizer.state.get(b.shard_param, {}) for b in opt.buckets]
    return copy.deepcopy({"state_dict": opt.state_dict(), "inner": inner,
                          "params": [p.detach() for p in model.parameters()],
                          "skipped_steps": opt.skipped_steps})


def _refused(model, opt, load, match):
    before = _snapshot(model, opt)
    assert len(opt.buckets) == 4 and opt.buckets[-1].names == ["0.weight"]
    with pytest.raises(ValueError, match=match):
        load()
    assert _same(_snapshot(model, opt), before)


def _set(path, value):
    def corrupt(sd):
        *keys, last = path
        target = sd
        for k in keys:
            target = target[k]
        target[last] = value(target[last]) if callable(value) else value
    return corrupt


CONSOLIDATED = {
    "step_two_elements": (_set(("state", 0, "step"), torch.tensor([1.0, 2.0])),
                          r"'step' of param 0 \(0.weight\).*shape \(2,\)"),
    "step_string": (_set(("state", 0, "step"), "three"), r"'step' of param 0 .*str"),
    "step_negative": (_set(("state", 0, "step"), torch.tensor(-1.0)), r"'step' of param 0"),
    "exp_avg_string": (_set(("state", 0, "exp_avg"), "garbage"),
                       r"'exp_avg' of param 0 \(0.weight\) is a str"),
    "exp_avg_sq_int8": (_set(("state", 0, "exp_avg_sq"), lambda t: t.to(torch.int8)),
                        r"'exp_avg_sq' of param 0 .*int8"),
    "exp_avg_shape": (_set(("state", 0, "exp_avg"), lambda t: t[:-1]),
                      r"'exp_avg' of param 0 .*shape \(15, 16\)"),
    "no_exp_avg_sq": (lambda sd: sd["state"][0].pop("exp_avg_sq"),
                      r"param 0 \(0.weight\) lacks \['exp_avg_sq'\]"),
    "entry_not_dict": (_set(("state", 0), [1, 2]), r"state of param 0 .*list"),
    "lr_string": (_set(("param_groups", 0, "lr"), "fast"), r"'lr' of param group 0"),
    "betas_length": (_set(("param_groups", 0, "betas"), (0.9,)), r"'betas' of param group 0"),
    "skipped_steps_string": (_set(("fastllm", "skipped_steps"), "x"), r"'skipped_steps'.*str"),
    "skipped_steps_float": (_set(("fastllm", "skipped_steps"), 1.5), r"'skipped_steps'"),
}


def _refused_load(corrupt, match, state_of, load):
    """A trained optimizer's state, corrupted, refused by another one, which stays as it was."""
    _, saved = _trained(2, 1)
    bad = copy.deepcopy(state_of(saved))
    corrupt(bad)
    model, opt = _trained(3, 2)
    _refused(model, opt, lambda: load(opt, bad), match)


@pytest.mark.parametrize("case", CONSOLIDATED)
def test_refused_load_state_dict_changes_nothing(case):
    _refused_load(*CONSOLIDATED[case], lambda o: o.state_dict(),
                  lambda o, bad: o.load_state_dict(bad))


def _split_range(sd):
    """0.weight's one range (world 1) as two that overlap: [0:128] and [64:256]."""
    st = sd["state"].pop("0.weight[0:256]")
    for a, c in ((0, 128), (64, 256)):
        sd["state"][f"0.weight[{a}:{c}]"] = {
            k: v[a:c] if k != "step" else v for k, v in st.items()}


SHARDED = {
    "truncated": (_set(("state", "0.weight[0:256]", "exp_avg"), lambda t: t[:-1]),
                  r"'exp_avg' of range '0.weight\[0:256\]' has 255 elements, the range 256"),
    "step_string": (_set(("state", "0.weight[0:256]", "step"), "x"),
                    r"'step' of range '0.weight\[0:256\]'"),
    "exp_avg_2d": (_set(("state", "0.weight[0:256]", "exp_avg"), lambda t: t.view(16, 16)),
                   r"'exp_avg' of range '0.weight\[0:256\]'.*1-D"),
    "no_exp_avg": (lambda sd: sd["state"]["0.weight[0:256]"].pop("exp_avg"),
                   r"range '0.weight\[0:256\]' lacks \['exp_avg'\]"),
    "bad_key": (lambda sd: sd["state"].update({"0.weight[0-256]": sd["state"].pop(
        "0.weight[0:256]")}), r"key '0.weight\[0-256\]'"),
    "outside": (lambda sd: sd["state"].update({"0.weight[0:257]": sd["state"].pop(
        "0.weight[0:256]")}), r"not inside the 256 elements of 0.weight"),
    "overlap": (_split_range, r"0.weight repeats elements \[64:128\]"),
    "lr_string": (_set(("param_groups", 0, "lr"), "fast"), r"'lr' of param group 0"),
}


@pytest.mark.parametrize("case", SHARDED)
def test_refused_load_sharded_state_dict_changes_nothing(case):
    _refused_load(*SHARDED[case], lambda o: o.sharded_state_dict(),
                  lambda o, bad: o.load_sharded_state_dict([bad]))


def test_good_loads_still_load():
    _, saved = _trained(2, 1)
    for load, state in (("load_state_dict", saved.state_dict()),
                        ("load_sharded_state_dict", [saved.sharded_state_dict()])):
        _, opt = _trained(3, 2)
        getattr(opt, load)(copy.deepcopy(state))
        assert _same(opt.state_dict(), saved.state_dict()), load


# --- PowerSGD ----------------------------------------------------------------------------------
SHAPES = [(16, 12), (12,), (8, 6)]


def _powersgd(steps, seed):
    """A PowerSGD after `steps` compressed reductions of one bucket (errors, P and Q held)."""
    state = PowerSGD(rank=2, start_iter=0, seed=0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        buf = torch.randn(sum(torch.Size(s).numel() for s in SHAPES), generator=g)
        grads, at = [], 0
        for s in SHAPES:
            grads.append(buf[at:at + torch.Size(s).numel()].view(s))
            at += grads[-1].numel()
        state.reduce_(buf, grads, 0)
    return state


POWERSGD = {
    **{f"no_{key}": (lambda sd, key=key: sd.pop(key), rf"lacks \['{key}'\]")
       for key in ("config", "iter", "rng", "errors", "p_memory", "q_memory", "layouts",
                   "numel")},
    "iter_string": (_set(("iter",), "x"), r"'iter' is a str"),
    "rng_keys_short": (_set(("rng", "keys"), lambda t: t[:10]), r"'rng'"),
    "numel_single": (_set(("numel",), (1,)), r"'numel'"),
    "error_truncated": (_set(("errors", 0), lambda t: t[:-1]),
                        r"'errors' of bucket 0 .*shape \(251,\)"),
    "q_memory_float64": (_set(("q_memory", 0), lambda t: t.double()),
                         r"'q_memory' of bucket 0 .*float64"),
    "p_memory_string": (_set(("p_memory", 0), "P"), r"'p_memory' of bucket 0 is a str"),
    "layout_dtype": (_set(("layouts", 0), lambda v: (v[0], "torch.int8", v[2])),
                     r"'layouts' of bucket 0"),
    "error_without_layout": (_set(("errors", 1), torch.zeros(3)), r"bucket 1.*'layouts'"),
    "q_without_p": (lambda sd: sd["p_memory"].pop(0), r"'p_memory' holds buckets \[\]"),
    "other_settings": (_set(("config", "rank"), 3), r"other settings"),
}


@pytest.mark.parametrize("case", POWERSGD)
def test_refused_powersgd_load_changes_nothing(case):
    corrupt, match = POWERSGD[case]
    bad = copy.deepcopy(_powersgd(2, 1).state_dict())
    corrupt(bad)
    state = _powersgd(3, 2)
    before = copy.deepcopy(state.state_dict())
    with pytest.raises(ValueError, match=match):
        state.load_state_dict(bad)
    assert _same(state.state_dict(), before)


def test_powersgd_good_load_still_loads():
    saved = _powersgd(2, 1)
    state = _powersgd(3, 2)
    state.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert _same(state.state_dict(), saved.state_dict())


def test_bf16_weights_loaded_after_construction_are_what_the_step_updates():
    """model.load_state_dict into bf16 params after the DistributedOptimizer exists (pretrained
    weights loaded late): the fp32 masters were copied at construction and the step wrote them
    back over the loaded weights, a fine-tune silently starting from the old ones."""
    model = _model().bfloat16()
    opt = DistributedOptimizer(model, stage=2, lr=1e-6, bucket_cap_mb=1e-4)
    model.load_state_dict({k: torch.full_like(v, 5.0) for k, v in model.state_dict().items()})
    opt.zero_grad()
    model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    opt.finish_param_sync()
    for name, p in model.named_parameters():
        assert torch.equal(p, torch.full_like(p, 5.0)), name  # (lr 1e-6: below bf16's step)


def test_clipping_p_grad_after_backward_is_refused_at_stage_2():
    """torch.nn.utils.clip_grad_norm_ between backward and step edits p.grad after stage 2 has
    reduced it into a shard of its own: the update ignored the clipping, silently."""
    model = _model()
    opt = DistributedOptimizer(model, stage=2, lr=1.0, bucket_cap_mb=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (100 * model(torch.randn(4, 16))).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with pytest.raises(RuntimeError, match="max_grad_norm"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()  # and the next step runs as usual
    model(torch.randn(4, 16)).sum().backward()
    opt.step()

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


@pytest.mark.parametrize("sharded", [False, True], ids=["state_dict", "sharded"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_resume_loading_the_model_then_the_optimizer_continues_exactly(stage, sharded):
    """A resume loads model.pt, then the optimizer (fastllm train's order): the model load
    counted as a write to the params, and the first step replaced the loaded fp32 masters by
    the bf16-rounded params (fastllm train zero1/zero2 bf16 runs did not resume exactly)."""
    def run(model, opt, seeds):
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g).bfloat16()).float().square().mean().backward()
            opt.step()
        opt.finish_param_sync()

    def make():
        model = _model().bfloat16()
        return model, DistributedOptimizer(model, stage=stage, lr=1e-2, bucket_cap_mb=1e-4)

    model, opt = make()
    run(model, opt, range(3))
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(opt.sharded_state_dict() if sharded else opt.state_dict())
    run(model, opt, range(3, 6))
    again, resumed = make()
    again.load_state_dict(weights)
    (resumed.load_sharded_state_dict if sharded else resumed.load_state_dict)(state)
    run(again, resumed, range(3, 6))
    assert _same(again.state_dict(), model.state_dict())
    assert _same(resumed.state_dict(), opt.state_dict())


def _edit_grads(model, edit):
    if edit == "clip":
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    elif edit == "replace":
        for p in model.parameters():
            p.grad = p.grad.clamp(-1e-3, 1e-3)
    elif edit == "replace_packed":  # bf16 params: p.grad is None once packed into fp32 buckets
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    else:  # set_to_none: the buckets keep the grads
        for p in model.parameters():
            p.grad = None


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("edit, dtype, match", [
    ("clip", torch.float32, r"grads of bucket 0 \(2.bias\) were changed in place.*max_grad_norm"),
    ("replace", torch.float32, r"grad of 2.bias was replaced.*max_grad_norm"),
    ("replace_packed", torch.bfloat16, r"grad of 2.bias was replaced.*max_grad_norm")])
def test_grads_edited_after_their_reduction_are_refused(stage, edit, dtype, match):
    """torch.nn.utils.clip_grad_norm_ or p.grad = p.grad.clamp(...) between backward and step,
    once a bucket's reduction was launched from backward: stage 1 took in-place edits only as
    far as they raced with the all-reduce, and both stages ignored replaced grads, silently.
    Refused before anything changes; the next step runs as usual."""
    model = _model().to(dtype)
    opt = DistributedOptimizer(model, stage=stage, lr=1.0, bucket_cap_mb=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    (100 * model(torch.randn(4, 16, dtype=dtype))).float().sum().backward()
    _edit_grads(model, edit)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    opt.zero_grad()
    model(torch.randn(4, 16, dtype=dtype)).float().sum().backward()
    opt.step()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("edit", ["clip", "replace", "set_to_none"])
def test_grads_edited_before_their_reduction_or_set_to_none_are_used(stage, edit):
    """Edits before the reduction is launched (overlap_grad_reduce=False: launched in step())
    reach the update; p.grad = None after backward leaves the bucket's grads, not refused. At
    world 1: equal to torch.optim.AdamW with the same edit (no edit for set_to_none)."""
    results = []
    for overlap in (None, edit == "set_to_none", False):
        model = _model()
        if overlap is None:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            opt = DistributedOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                       bucket_cap_mb=1e-4, overlap_grad_reduce=overlap)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g)).square().sum().backward()
            if overlap is not None or edit != "set_to_none":
                _edit_grads(model, edit)
            opt.step()
        if overlap is not None:
            opt.finish_param_sync()
        results.append([p.detach().clone() for p in model.parameters()])
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_load_state_dict_after_step_waits_for_the_param_gather():
    """overlap_param_gather: model.load_state_dict() right after step() (restoring a checkpoint,
    swapping EMA weights in) raced with the all-gather still in flight, which then wrote the
    step's params over the loaded ones."""
    model = _model()
    opt = DistributedOptimizer(model, stage=2, lr=1e-2, bucket_cap_mb=1e-4,
                               overlap_param_gather=True)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        assert opt._gathers_pending
        model.load_state_dict(saved)
        assert not opt._gathers_pending  # the gathers finished before the load
        with torch.no_grad():
            model(torch.randn(1, 16))
        assert _same(model.state_dict(), saved)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer_class", [None, torch.optim.AdamW])
def test_fp64_params_train_as_torch_adamw_in_fp64(stage, optimizer_class):
    """fp64 models were accepted at construction, then step() failed inside fastllm.scaled_copy
    (fp32/bf16/fp16 only). Now their buckets stay fp64: equal to torch.optim.AdamW in fp64 with
    clip_grad_norm_ to fp64 rounding, clipping active."""
    results = []
    for distributed in (False, True):
        model = _model().double()
        if distributed:
            opt = DistributedOptimizer(model, optimizer_class, stage=stage, lr=1e-2,
                                       weight_decay=0.1, bucket_cap_mb=1e-4, max_grad_norm=0.05)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(4)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 16, generator=g, dtype=torch.float64)).square().sum().backward()
            if not distributed:
                norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
        if distributed:
            opt.finish_param_sync()
            assert opt.grad_norm.dtype == torch.float64
            torch.testing.assert_close(opt.grad_norm, norm, rtol=1e-13, atol=0)
        assert norm > 0.05
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert a.dtype == torch.float64
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn])
def test_unsupported_param_dtypes_are_refused_at_construction(dtype):
    model = _model()
    model.extra = torch.nn.Parameter(torch.zeros(3).to(dtype))
    with pytest.raises(TypeError, match=rf"parameter extra is {dtype}"):
        DistributedOptimizer(model, lr=1e-2)


def test_sharded_state_dict_saved_before_the_first_step_loads_as_no_state():
    """A step-0 sharded_state_dict() (a DCP checkpoint before training) was refused ("the shards
    hold no state") while the consolidated state_dict() of the same moment loaded."""
    fresh = DistributedOptimizer(_model(), stage=2, lr=0.5, bucket_cap_mb=1e-4)
    saved = fresh.sharded_state_dict()
    assert saved["state"] == {}
    _, opt = _trained(3, 2)
    opt.load_sharded_state_dict([copy.deepcopy(saved)])
    assert not opt.state and opt.param_groups[0]["lr"] == 0.5
    assert _same(opt.state_dict()["state"], {})
    with pytest.raises(ValueError, match="no state"):
        opt.load_sharded_state_dict([])


# --- no_decay: a group of its own with weight_decay 0 -----------------------------------------
NO_DECAY = ["0.bias", "2.bias"]  # _model()'s 1-D params: the biases


def _two_groups(model):
    """[matrices, vectors with weight_decay 0] in model order: the other strategies' groups."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n not in NO_DECAY]},
            {"params": [p for n, p in named if n in NO_DECAY], "weight_decay": 0.0}]


def _steps(model, opt, seed, steps=3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=g)).square().mean().backward()
        opt.step()
    if hasattr(opt, "finish_param_sync"):
        opt.finish_param_sync()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer_class", [None, torch.optim.AdamW])
def test_no_decay_trains_and_saves_as_torch_adamw_with_two_groups(stage, optimizer_class):
    """no_decay's params get weight_decay 0 in a group of their own, as torch.optim.AdamW with
    groups [matrices, vectors (weight_decay 0)], whose state_dicts load both ways; a checkpoint
    of the other group layout is refused, by both loads, changing nothing."""
    def dist_opt(model, **kwargs):
        return DistributedOptimizer(model, optimizer_class, stage=stage, lr=1e-2,
                                    weight_decay=0.1, bucket_cap_mb=1e-4, **kwargs)

    model, ref_model = _model(), _model()
    opt = dist_opt(model, no_decay=NO_DECAY)
    ref = torch.optim.AdamW(_two_groups(ref_model), lr=1e-2, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert all(len({n in NO_DECAY for n in b.names}) == 1 for b in opt.buckets)
    for got, want in zip(_steps(model, opt, 5), _steps(ref_model, ref, 5)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # weight decay matters here: one group (decay on the biases too) trains other biases
    one_model = _model()
    one = _steps(one_model, dist_opt(one_model), 5)
    assert not torch.allclose(one[1], _steps(_model(), dist_opt(_model(), no_decay=NO_DECAY),
                                              5)[1], rtol=1e-5, atol=1e-6)

    saved = opt.state_dict()
    # numbered as torch numbers a two-group optimizer's params (in group order): the indices of
    # fastllm train's optimizer.pt under every strategy
    assert [(g["weight_decay"], g["params"]) for g in saved["param_groups"]] == [
        (g["weight_decay"], g["params"]) for g in ref.state_dict()["param_groups"]] == [
        (0.1, [0, 1]), (0.0, [2, 3])]
    # each loads the other's state and then steps as it: (loader, its model, saver, its model)
    for direction, build, source, source_model in (
            ("into torch", lambda m: torch.optim.AdamW(_two_groups(m), lr=1e-2), opt, model),
            ("from torch", lambda m: dist_opt(m, no_decay=NO_DECAY), ref, ref_model)):
        b = _model()
        b.load_state_dict(source_model.state_dict())
        loaded = build(b)
        loaded.load_state_dict(copy.deepcopy(source.state_dict()))
        assert [g["weight_decay"] for g in loaded.param_groups] == [0.1, 0.0]
        for got, want in zip(_steps(b, loaded, 6, 2), _steps(source_model, source, 6, 2)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=direction)
    one_group = dist_opt(_model())
    for load, state in (("load_state_dict", saved),
                        ("load_sharded_state_dict", [opt.sharded_state_dict()])):
        before = copy.deepcopy(one_group.state_dict())
        with pytest.raises(ValueError, match=r"param groups of .*no_decay"):
            getattr(one_group, load)(copy.deepcopy(state))
        assert _same(one_group.state_dict(), before)
    with pytest.raises(ValueError, match=r"param groups of .*no_decay"):
        dist_opt(_model(), no_decay=NO_DECAY).load_state_dict(one_group.state_dict())
    # the sharded state of the two groups reloads as it was saved
    fresh = dist_opt(_model(), no_decay=NO_DECAY)
    fresh.load_sharded_state_dict([copy.deepcopy(opt.sharded_state_dict())])
    assert _same(fresh.state_dict(), opt.state_dict())


def test_no_decay_with_galore_matches_single_process_groups():
    """GaLoreAdamW with no_decay: groups [projected, flat decayed, flat no_decay], the same
    updates as a single-process GaLoreAdamW with those groups."""
    from fastllm.optim import GaLoreAdamW

    model, ref_model = _model(), _model()
    opt = DistributedOptimizer(model, GaLoreAdamW, stage=2, lr=1e-2, weight_decay=0.1,
                               bucket_cap_mb=1e-4, rank=2, galore_params=[model[0].weight],
                               no_decay=NO_DECAY)
    ref = GaLoreAdamW([dict(params=[ref_model[0].weight], rank=2),
                       {"params": [ref_model[2].weight]},
                       {"params": [ref_model[0].bias, ref_model[2].bias], "weight_decay": 0.0}],
                      lr=1e-2, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1, 0.0]
    for got, want in zip(_steps(model, opt, 7), _steps(ref_model, ref, 7)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert [g["params"] for g in opt.state_dict()["param_groups"]] == [
        g["params"] for g in ref.state_dict()["param_groups"]] == [[0], [1], [2, 3]]


def test_bad_no_decay_is_refused():
    with pytest.raises(ValueError, match=r"not trainable parameters of model: \['fc.bias'\]"):
        DistributedOptimizer(_model(), lr=1e-2, no_decay=["0.bias", "fc.bias"])
    with pytest.raises(TypeError, match="iterable of parameter names"):
        DistributedOptimizer(_model(), lr=1e-2, no_decay="0.bias")

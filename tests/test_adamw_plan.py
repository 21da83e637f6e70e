"""fastllm.optim.AdamW's cached step plan (fastllm/optim/_plan.py) and its load checks: whatever
changes between steps (new grad tensors, a grad vanishing, a param group added, a scheduled lr,
a non-contiguous grad) gives what torch.optim.AdamW gives; bad input found at a cached step is
refused before anything changes; another optimizer's state_dict is refused (issue 16 item 8)."""

import copy
import io

import pytest
import torch

import fastllm


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _snapshot(opt, model):
    out = [p.detach().clone() for p in model.parameters()]
    for state in opt.state.values():
        out += [t.detach().clone() for t in state.values() if isinstance(t, torch.Tensor)]
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [
    lambda ps: fastllm.optim.AdamW(ps, lr=1e-2),
    lambda ps: fastllm.optim.AdamW(ps, lr=1e-2, max_grad_norm=0.5),
])
def test_changes_between_steps_match_torch(make):
    model, ref_model = _model(), _model()
    opt = make(model.parameters())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=2, gamma=0.5)
    extra, ref_extra = (torch.nn.Parameter(torch.ones(4, 6)) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        x = torch.randn(9, 7, generator=gen)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()  # set_to_none: new grad tensors every step
            m(x).square().mean().backward()
        if step == 2:  # a grad vanishes for one step
            model[2].bias.grad = ref_model[2].bias.grad = None
        if step == 3:
            opt.add_param_group({"params": [extra]})
            ref.add_param_group({"params": [ref_extra]})
        if step >= 3:
            g = torch.randn(6, 4, generator=gen).t()  # non-contiguous
            extra.grad, ref_extra.grad = g, g.clone()
        if max_norm := getattr(opt, "max_grad_norm", None):
            torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()) + [ref_extra], max_norm)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    for a, b in zip(list(model.parameters()) + [extra], list(ref_model.parameters()) + [ref_extra]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for p, q in zip(list(model.parameters()) + [extra], list(ref_model.parameters()) + [ref_extra]):
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"])
    # The step counts are views of one buffer per call: state_dict and torch still read them.
    torch_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    torch_opt.add_param_group({"params": [ref_extra]})
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))


def test_bad_input_at_a_cached_step_changes_nothing():
    model = _model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    opt.step()  # the plan is cached now
    before = _snapshot(opt, model)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.step()
    assert _same(before, _snapshot(opt, model))
    opt.param_groups[0]["lr"] = 1e-2
    model[0].weight.grad = torch.zeros(5, 7).to_sparse()  # a new grad the kernels cannot take
    with pytest.raises(RuntimeError, match="sparse gradients.*param 0 of param group 0"):
        opt.step()
    assert _same(before, _snapshot(opt, model))


def test_tensor_lr_message_has_torchs_wording():
    params = _model().parameters()
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        fastllm.optim.AdamW(params, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match=r"Tensor betas\[0\] must be 1-element"):
        fastllm.optim.AdamW(params, betas=(torch.tensor([0.9, 0.9]), torch.tensor(0.99)))


@pytest.mark.parametrize("cls", [fastllm.optim.AdamW, fastllm.optim.AdamW8bit])
def test_another_optimizers_state_is_refused_before_anything_changes(cls):
    model = _model()
    kwargs = {"min_8bit_size": 16} if cls is fastllm.optim.AdamW8bit else {}
    opt = cls(model.parameters(), lr=1e-2, **kwargs)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    before = _snapshot(opt, model)
    groups = copy.deepcopy(opt.param_groups)
    sgd = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    _model()(torch.randn(4, 7)).sum().backward()
    for p, q in zip(sgd.param_groups[0]["params"], model.parameters()):
        p.grad = torch.zeros_like(q)
    sgd.step()
    with pytest.raises((ValueError, RuntimeError), match="another optimizer"):
        opt.load_state_dict(sgd.state_dict())
    # A state without exp_avg_sq (the fp32 bias below min_8bit_size keeps torch's keys).
    sd = copy.deepcopy(opt.state_dict())
    bias = len(list(model.parameters())) - 1
    del sd["state"][bias]["exp_avg_sq"]
    with pytest.raises(RuntimeError, match="exp_avg_sq"):
        opt.load_state_dict(sd)
    assert _same(before, _snapshot(opt, model))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in groups]
    opt.step()  # still steps


@pytest.mark.parametrize("reset", ["clear", "del", "replace", "clear_one"])
def test_state_reset_by_hand_is_initialised_again_as_torch(reset):
    """ReLoRA-style resets (`optimizer.state.clear()`, `del optimizer.state[p]`, a new empty
    dict, `optimizer.state[p].clear()`) between cached steps: torch starts the state again, so
    must the plan."""
    model, ref_model = _model(), _model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        x = torch.randn(9, 7, generator=gen)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            if step == 3:
                first = next(m.parameters())
                if reset == "clear":
                    o.state.clear()
                elif reset == "del":
                    del o.state[first]
                elif reset == "clear_one":
                    o.state[first].clear()
                else:
                    o.state[first] = {}
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"])
    assert len(opt.state_dict()["state"]) == len(ref.state_dict()["state"]) == 4


@pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout")
def test_betas_list_edited_in_place_and_layout_changes_are_seen():
    """What keeps the identity of everything the plan compares: a group's betas list edited in
    place, a param given non-contiguous memory (`p.data = w`), a grad given non-contiguous
    memory (`p.grad.data = g`). Each is stepped as torch steps it."""
    model, ref_model = _model(), _model()
    opt = fastllm.optim.AdamW([{"params": list(model.parameters()), "betas": [0.9, 0.999]}],
                              lr=1e-2)
    ref = torch.optim.AdamW([{"params": list(ref_model.parameters()), "betas": [0.9, 0.999]}],
                            lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        x = torch.randn(9, 7, generator=gen)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad(set_to_none=False)  # the same grad tensors every step
            m(x).square().mean().backward()
            if step == 2:
                o.param_groups[0]["betas"][1] = 0.5
            if step == 3:
                m[0].weight.data = m[0].weight.data.t().contiguous().t()
            if step == 4:
                m[2].weight.grad.data = m[2].weight.grad.data.t().contiguous().t()
            o.step()
    assert not model[0].weight.is_contiguous()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"],
                                   rtol=1e-5, atol=1e-9)


def test_a_param_listed_twice_is_refused():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="lists a parameter twice.*index 1"):
        fastllm.optim.AdamW([p, p])
    opt = fastllm.optim.AdamW([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="param group 1 lists a parameter twice"):
        opt.add_param_group({"params": iter([("a", p), ("b", p)])})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": (q for q in [p])})  # a generator is read once, as torch does
    assert opt.param_groups[1]["params"] == [p]


@pytest.mark.parametrize("write", ["data_assign", "vector_to_parameters"])
def test_master_weights_see_a_param_given_new_memory(write):
    """`p.data = w` and torch.nn.utils.vector_to_parameters replace a bf16 param's memory without
    touching its version counter: the fp32 master is re-synced from the new values instead of
    being written back over them."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4).to(torch.bfloat16)
    opt = fastllm.optim.AdamW(lin.parameters(), lr=1e-8, master_weights=True)
    for _ in range(2):
        opt.zero_grad()
        lin(torch.randn(3, 6, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
    zeros = torch.zeros(sum(p.numel() for p in lin.parameters()), dtype=torch.bfloat16)
    if write == "data_assign":
        for p in lin.parameters():
            p.data = torch.zeros_like(p)
    else:
        torch.nn.utils.vector_to_parameters(zeros, lin.parameters())
    opt.step()  # same grads, lr 1e-8: the params stay ~0
    for p in lin.parameters():
        assert p.abs().max().item() < 1e-6
        assert opt.state[p]["master_param"].abs().max().item() < 1e-6


def _replan(opt, how, extra):
    """The optimizer after `how`: one that forgets its cached plan, or a copy of it."""
    if how == "invalidate":
        opt.invalidate_plan()
    elif how == "add_param_group":
        opt.add_param_group({"params": [extra]})
    elif how == "deepcopy":
        return copy.deepcopy(opt)
    else:
        buffer = io.BytesIO()
        torch.save(opt, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    return opt


def _master_after(how, write):
    """The first param's master after two steps (a plan rebuilt at the second: a grad vanished),
    `how` (None: nothing), a write of 100 to the param under no_grad or none, one step."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=gen).bfloat16()) for _ in range(2)]
    extra = torch.nn.Parameter(torch.randn(3, generator=gen).bfloat16())
    opt = fastllm.optim.AdamW(params, lr=1e-2, master_weights=True)
    grads = [[torch.randn(7, 5, generator=gen).bfloat16() for _ in params] for _ in range(3)]
    for k in range(2):
        for p, g in zip(params, grads[k]):
            p.grad = None if (k == 1 and p is params[1]) else g
        opt.step()
    if how is not None:
        opt = _replan(opt, how, extra)
    params = opt.param_groups[0]["params"]
    if write:
        with torch.no_grad():
            params[0].fill_(100.0)
    for p, g in zip(params, grads[2]):
        p.grad = g
    opt.step()
    return opt.state[params[0]]["master_param"]


@pytest.mark.parametrize("how", ["invalidate", "add_param_group", "deepcopy", "pickle"])
@pytest.mark.parametrize("write", [False, True], ids=["no_write", "write"])
def test_master_versions_survive_a_new_plan_or_a_copy(how, write):
    """After invalidate_plan(), add_param_group() or a copy of the optimizer, a master in sync
    with its bf16 param keeps its fp32 precision (it is not re-synced from the param), and a
    write to the param under no_grad is taken (the master is re-synced from it): the same
    master as without them, bitwise."""
    master = _master_after(how, write)
    assert torch.equal(master, _master_after(None, write))
    if write:
        assert abs(master.mean().item() - 100.0) < 0.1


def test_tensor_betas_with_one_cycle_momentum_step_as_torch():
    """OneCycleLR(cycle_momentum=True) writes (float, Tensor) betas over Tensor betas: torch
    checks "both floats or both Tensors" at construction only and steps on; so must fastllm."""
    model, ref_model = _model(), _model()
    betas = (torch.tensor(0.9), torch.tensor(0.999))
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2, betas=betas)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, betas=betas, foreach=False)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=10)
              for o in (opt, ref)]
    gen = torch.Generator().manual_seed(4)
    for _ in range(4):
        x = torch.randn(9, 7, generator=gen)
        for m, o, s in ((model, opt, scheds[0]), (ref_model, ref, scheds[1])):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
            s.step()
    assert not isinstance(opt.param_groups[0]["betas"][0], torch.Tensor)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="both floats or both Tensors"):
        fastllm.optim.AdamW(model.parameters(), betas=(0.9, torch.tensor(0.999)))


def test_amsgrad_turned_on_after_steps_is_refused_clearly_and_changes_nothing():
    """The cached plan holds no max_exp_avg_sq lists: the step must see the change and refuse
    it with the message an uncached plan gives (torch fails on the missing state too)."""
    model = _model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 7)).square().mean().backward()
        opt.step()
    opt.param_groups[0]["amsgrad"] = True
    before = _snapshot(opt, model)
    with pytest.raises(RuntimeError, match="'max_exp_avg_sq' .* is missing"):
        opt.step()
    assert _same(before, _snapshot(opt, model))
    opt.param_groups[0]["amsgrad"] = False
    opt.step()  # still steps


@pytest.mark.parametrize("key,start,new", [("weight_decay", 0.0, 0.5), ("eps", 1e-8, 1.0)])
def test_tensor_eps_and_weight_decay_changed_in_place_are_seen(key, start, new):
    """The plan cached a tensor eps or weight_decay's float by the tensor's identity: a
    schedule's in-place `fill_` was ignored (torch.optim.AdamW reads it every step), and a
    `fill_` of nan was not refused."""
    model, ref_model = _model(), _model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    for o in (opt, ref):
        o.param_groups[0][key] = torch.tensor(start)
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        if step == 2:
            for o in (opt, ref):
                o.param_groups[0][key].fill_(new)
        x = torch.randn(4, 7, generator=gen)
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    opt.param_groups[0][key].fill_(float("nan"))
    before = _snapshot(opt, model)
    with pytest.raises(ValueError, match="Invalid (epsilon|weight_decay) value"):
        opt.step()
    assert _same(before, _snapshot(opt, model))


@pytest.mark.parametrize("change", ["move_to_group", "move_to_maximize", "neg_grad_data"])
def test_what_the_cached_plan_cannot_see_by_identity_rebuilds_it(change):
    """The cached step plan compared the flattened params, states and grads: a param moved into
    another group (the flattened order unchanged) kept its old group's lr / maximize, and a grad
    given a negative bit through `p.grad.data = ...` was read raw (its sign lost). Each step
    against torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(8, generator=gen) for _ in range(3)]

    def make(cls):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        return params, cls([{"params": params[:2], "lr": 1e-3},
                            {"params": params[2:], "lr": 1e-1,
                             "maximize": change == "move_to_maximize"}])

    (ours, opt), (theirs, ref) = make(fastllm.optim.AdamW), make(torch.optim.AdamW)
    for step in range(4):
        grads = [torch.randn(8, generator=gen) for _ in range(3)]
        for p, q, g in zip(ours, theirs, grads):
            q.grad = g.clone()
            if p.grad is None:
                p.grad = g.clone()
            elif step == 2 and change == "neg_grad_data":  # the same grad tensor, its values
                p.grad.data = (-g)._neg_view()  # behind a negative bit
            else:
                p.grad.copy_(g)  # (the same grad tensors: the plan's fast path)
        if step == 2 and change == "neg_grad_data":
            assert all(p.grad.is_neg() for p in ours)
        elif step == 2:
            for o in (opt, ref):
                o.param_groups[1]["params"].insert(0, o.param_groups[0]["params"].pop())
        opt.step()
        ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make", [
    lambda ps: fastllm.optim.AdamW(ps, lr=1e-2),
    lambda ps: fastllm.optim.AdamW(ps, lr=1e-2, master_weights=True, max_grad_norm=1.0),
    lambda ps: fastllm.optim.AdamW8bit(ps, lr=1e-2),
], ids=["plain", "master", "8bit"])
def test_the_plan_lets_go_of_the_grads_after_the_step(make, request):
    """The cached plan held the step's grads until the next step swapped them out, so after
    zero_grad() (set_to_none, the default) they lived through the next backward beside the new
    ones: a model's size of grads more at the peak, where torch.optim holds none. With grads kept
    across steps (set_to_none=False) the plan is reused as it was (the plain one: torch's steps)."""
    import weakref

    model, ref_model = _model(), _model()
    opt = make(model.parameters())
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    x = torch.randn(4, 7)
    model(x).sum().backward()
    opt.step()
    old = [weakref.ref(p.grad) for p in model.parameters()]
    opt.zero_grad()
    assert all(r() is None for r in old)  # freed: nothing holds them now
    for set_to_none in (True, False, False):
        model(x).sum().backward()
        plan = opt._plan
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        assert opt._plan is plan  # (a grad swapped in or kept: the plan is not rebuilt)
    for set_to_none in (True, True, False, False):
        ref_model(x).sum().backward()
        ref.step()
        ref.zero_grad(set_to_none=set_to_none)
    if request.node.callspec.id == "plain":
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_params_over_the_same_memory_are_refused_views_of_one_buffer_are_not():
    """Two Parameters over the same memory (`nn.Parameter(p.data)` beside p): the fused kernels
    update every param of a call at once, so one update was lost at random (torch.optim applies
    them one after the other); refused before anything changes, naming both. Params that are
    disjoint views of one flat buffer step as torch does."""
    a = torch.nn.Parameter(torch.randn(64))
    b = torch.nn.Parameter(a.data[32:])  # overlaps a's second half
    for p in (a, b):
        p.grad = torch.randn_like(p)
    before = (a.detach().clone(), b.detach().clone())
    opt = fastllm.optim.AdamW([{"params": [a]}, {"params": [b]}], lr=1e-2)
    with pytest.raises(ValueError, match=r"param 0 of param group 0 \(shape \(64,\)\) and param "
                                         r"0 of param group 1 \(shape \(32,\)\) overlap in memory"):
        opt.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1]) and not opt.state
    flat = torch.randn(10)
    views = [torch.nn.Parameter(flat[:4]), torch.nn.Parameter(flat[4:].view(2, 3))]
    copies = [torch.nn.Parameter(v.detach().clone()) for v in views]
    for p, q in zip(views, copies):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    fastllm.optim.AdamW(views, lr=1e-2).step()
    torch.optim.AdamW(copies, lr=1e-2).step()
    for p, q in zip(views, copies):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_a_grad_gone_after_the_plan_let_go_of_it_steps_as_torch():
    """A param frozen between steps (requires_grad off, its grad set to None and so freed) while
    the others keep their grads (zero_grad(set_to_none=False)): its grad's dead weak reference
    in the plan must not be taken for that step's None; the param is skipped, as torch does."""
    model, ref_model = _model(), _model()
    opt = fastllm.optim.AdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    x = torch.randn(4, 7)
    for m, o in ((model, opt), (ref_model, ref)):
        m(x).sum().backward()
        o.step()
        o.zero_grad(set_to_none=False)
        m[0].weight.requires_grad_(False)
        m[0].weight.grad = None
        m(x).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

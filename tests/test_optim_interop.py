"""fastllm.optim.AdamW / AdamW8bit as a torch.optim.Optimizer, against torch.optim.AdamW doing the
same thing: state_dict round trips both ways, the state_dict and load_state_dict hooks (called as
torch calls them, seeing and keeping what torch's would), and state_dicts that must be refused
before anything changes.
"""

import copy

import pytest
import torch

from fastllm.amp import LossScaler
from fastllm.optim import AdamW, AdamW8bit, GaLoreAdamW, convert_state


def _params(shapes=((6, 5), (4,)), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def _train(opt, steps, seed=0):
    params = [p for g in opt.param_groups for p in g["params"]]
    for s in range(steps):
        _grads(params, seed + s)
        opt.step()


def _clone(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _state_tensors(opt):
    return {(i, k): v.clone() for i, p in enumerate(opt.param_groups[0]["params"])
            for k, v in opt.state[p].items()}


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key


@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, True)])
def test_torch_state_dict_round_trip_continues_as_torch(dtype, master):
    ref, ours = _params(dtype=dtype), _params(dtype=dtype)
    torch_ref, torch_ours = (torch.optim.AdamW(p, lr=1e-2) for p in (ref, ours))
    _train(torch_ref, 3)
    _train(torch_ours, 3)
    opt = AdamW(ours, lr=1e-2, master_weights=master)
    opt.load_state_dict(torch_ours.state_dict())
    assert isinstance(opt.state[ours[0]]["step"], torch.Tensor)
    back = torch.optim.AdamW(ours, lr=1e-2)
    back.load_state_dict(opt.state_dict())  # before any fastllm step: the torch state unchanged
    _train(torch_ref, 2, seed=3)
    _train(back, 2, seed=3)
    for a, b in zip(ref, ours):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_load_pre_hook_result_is_what_is_checked_and_loaded():
    # A pre-hook may return a new state_dict (torch loads that one): here it converts a saved
    # 8-bit state to torch's layout, which the fp32 optimizer then continues from as torch does.
    params = _params(((64, 64), (3,)))
    q8 = AdamW8bit(params, lr=1e-2, min_8bit_size=16)
    _train(q8, 2)
    saved = q8.state_dict()
    ref, ours = _clone(params), _clone(params)
    results = []
    for opt in (torch.optim.AdamW(ref, lr=1e-2), AdamW(ours, lr=1e-2)):
        opt.register_load_state_dict_pre_hook(lambda o, sd: convert_state(sd, torch.float32))
        opt.load_state_dict(copy.deepcopy(saved))  # (torch's load keeps the step tensors)
        _train(opt, 2, seed=5)
        results.append([p.detach() for p in opt.param_groups[0]["params"]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # a few ulps over 2 steps


@pytest.mark.parametrize("make", [
    lambda ps: AdamW(ps, lr=1e-2, master_weights=True),
    lambda ps: GaLoreAdamW([{"params": ps[:1], "rank": 2}, {"params": ps[1:]}], lr=1e-2,
                           master_weights=True),
], ids=["AdamW", "GaLoreAdamW"])
def test_load_post_hook_sees_and_keeps_the_loaded_state(make):
    # torch calls the post-hooks once the state is loaded: they see it as the optimizer keeps it
    # (fp32 masters and moments for bf16 params, not torch's bf16 casts of them), and what they
    # change stays.
    params = _params(dtype=torch.bfloat16)
    opt = make(params)
    _train(opt, 2)
    seen = {}

    def hook(optimizer):
        state = optimizer.state[params[0]]
        seen.update({k: v.dtype for k, v in state.items()})
        state["exp_avg"].zero_()

    opt.register_load_state_dict_post_hook(hook)
    opt.load_state_dict(opt.state_dict())
    assert {"step", "exp_avg", "exp_avg_sq", "master_param"} <= seen.keys()
    assert set(seen.values()) == {torch.float32}
    assert opt.state[params[0]]["exp_avg"].abs().max().item() == 0.0


@pytest.mark.parametrize("make,key", [
    (lambda p: AdamW(p, lr=1e-2, max_grad_norm=1.0), "fastllm"),
    (lambda p: AdamW8bit(p, lr=1e-2, min_8bit_size=16), "fastllm_lowbyte"),
], ids=["AdamW", "AdamW8bit"])
def test_state_dict_post_hook_sees_the_whole_state_dict(make, key):
    # torch hands the post-hooks the finished state_dict and returns what they return.
    opt = make(_params(((8, 8),)))
    _train(opt, 1)
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sorted(sd)))
    opt.register_state_dict_post_hook(lambda o, sd: {"replaced": True})
    assert opt.state_dict() == {"replaced": True}
    assert key in seen[0]


@pytest.mark.parametrize("mutate", [
    lambda sd: sd["fastllm"].update(loss_scaler={"scale": 1.0}),
    lambda sd: sd["fastllm"].update(skipped_steps="x"),
    lambda sd: sd["fastllm"].update(sr_seed="x"),
], ids=["loss_scaler", "skipped_steps", "sr_seed"])
def test_corrupt_fastllm_entry_is_refused_before_anything_changes(mutate):
    other = AdamW(_params(seed=1), lr=1e-2, loss_scaler=LossScaler(init_scale=8.0))
    _train(other, 3)
    saved = copy.deepcopy(other.state_dict())
    mutate(saved)
    params = _params()
    opt = AdamW(params, lr=1e-2, loss_scaler=LossScaler())
    _train(opt, 1)
    before, scaler = _state_tensors(opt), opt.loss_scaler.state_dict()
    with pytest.raises((ValueError, KeyError, TypeError)):
        opt.load_state_dict(saved)
    _assert_same_state(before, _state_tensors(opt))
    assert opt.loss_scaler.state_dict() == scaler


@pytest.mark.parametrize("make", [lambda p: AdamW(p, lr=1e-2),
                                  lambda p: AdamW8bit(p, lr=1e-2, min_8bit_size=16)],
                         ids=["AdamW", "AdamW8bit"])
def test_step_of_several_elements_is_refused_at_load(make):
    params = _params(((64, 64), (3,)))
    opt = make(params)
    _train(opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["step"] = torch.tensor([3.0, 3.0])
    before = _state_tensors(opt)
    with pytest.raises(RuntimeError, match="'step'"):
        opt.load_state_dict(saved)
    _assert_same_state(before, _state_tensors(opt))


@pytest.mark.parametrize("make", [lambda p: AdamW(p, lr=1e-2),
                                  lambda p: AdamW8bit(p, lr=1e-2, min_8bit_size=16)],
                         ids=["AdamW", "AdamW8bit"])
@pytest.mark.parametrize("step", [-5.0, float("nan"), -1])
def test_negative_or_nan_step_is_refused_at_load(make, step):
    """torch refuses to step such a state; the fused kernels would write non-finite params."""
    params = _params(((64, 64), (3,)))
    opt = make(params)
    _train(opt, 1)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][1]["step"] = step if isinstance(step, int) else torch.tensor(step)
    before = _state_tensors(opt)
    with pytest.raises(RuntimeError, match="'step'.*finite count"):
        opt.load_state_dict(saved)
    _assert_same_state(before, _state_tensors(opt))


@pytest.mark.parametrize("make", [lambda p: AdamW(p, lr=1e-2, master_weights=True),
                                  lambda p: AdamW8bit(p, lr=1e-2, min_8bit_size=16,
                                                      master_weights=True)],
                         ids=["AdamW", "AdamW8bit"])
def test_master_cast_to_bf16_by_torch_is_upcast_at_load(make):
    """A master_weights state_dict loaded into torch.optim.AdamW and saved again holds a bf16
    master (torch casts state to its param's dtype): it loads as the fp32 master it equals, and
    the next steps run."""
    params = _params(((64, 64), (3,)), dtype=torch.bfloat16)
    opt = make(params)
    _train(opt, 2)
    if isinstance(opt, AdamW8bit):  # (torch would cast the 8-bit codes too: cast the masters)
        saved = copy.deepcopy(opt.state_dict())
        for state in saved["state"].values():
            state["master_param"] = state["master_param"].bfloat16()
    else:
        through = torch.optim.AdamW(params, lr=1e-2)
        through.load_state_dict(copy.deepcopy(opt.state_dict()))
        saved = through.state_dict()
    assert saved["state"][0]["master_param"].dtype == torch.bfloat16
    again = make(params)
    again.load_state_dict(saved)
    for i, p in enumerate(params):
        master = again.state[p]["master_param"]
        assert master.dtype == torch.float32
        assert torch.equal(master, saved["state"][i]["master_param"].float())
    _train(again, 2, seed=5)
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("make,dtype", [
    (lambda ps: AdamW(ps), torch.float32),
    (lambda ps: AdamW(ps, master_weights=True), torch.bfloat16),
    (lambda ps: AdamW(ps, max_grad_norm=1.0), torch.float32),
    (lambda ps: AdamW8bit(ps), torch.float32),
], ids=["adamw", "master_bf16", "clipped", "8bit"])
def test_params_on_the_meta_device_step_as_torch_does(make, dtype):
    """torch.optim.AdamW steps a model built under torch.device("meta") (no values: it makes the
    state there); fastllm's direct kernel call read a step count on the host ("Tensor.item()
    cannot be called on meta tensors")."""
    def model():
        with torch.device("meta"):
            m = torch.nn.Linear(8, 4).to(dtype)
        m(torch.empty(2, 8, device="meta", dtype=dtype)).sum().backward()
        return m

    ours, theirs = model(), model()
    opt, ref = make(ours.parameters()), torch.optim.AdamW(theirs.parameters())
    for _ in range(2):
        opt.step()
        ref.step()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert p.is_meta and p.shape == q.shape
        state = opt.state[p]
        assert state and all(t.is_meta for t in state.values() if torch.is_tensor(t))
        for key in ("exp_avg", "exp_avg_sq"):
            if key in ref.state[q] and state[key].dtype == ref.state[q][key].dtype:
                assert state[key].shape == ref.state[q][key].shape


def test_galore_refuses_params_on_the_meta_device_by_name():
    """GaLore's projection needs values (a range finder over the grad): a meta param is refused
    before anything is made, not failed on a host read ("Tensor.item() cannot be called")."""
    with torch.device("meta"):
        m = torch.nn.Linear(8, 4)
    m(torch.empty(2, 8, device="meta")).sum().backward()
    opt = GaLoreAdamW([{"params": [m.weight], "rank": 2}, {"params": [m.bias]}])
    with pytest.raises(RuntimeError, match=r"param 0 of param group 0 .* is on the meta device"):
        opt.step()
    assert not opt.state

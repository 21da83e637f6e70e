"""BAdam: only the active block changes and holds state, the switching order follows the mode,
the default blocks follow the layer names, a resumed run switches at the same steps to the same
blocks, and under DDP (world 2) it matches one process."""

import io

import pytest
import torch
import torch.nn as nn

import fastllm
from fastllm.distributed.launch import spawn
from fastllm.optim import BAdam
from fastllm.optim.badam import _matches, default_blocks


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    return (model(x) - y).square().mean()


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()


def test_only_the_active_block_changes_and_holds_state():
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2)
    assert opt.blocks == [["0."], ["2."], ["4."]]
    names = [n for n, _ in model.named_parameters()]
    for step in range(7):
        active = opt.active_block
        prefix = opt.blocks[active][0]
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            assert p.requires_grad == n.startswith(prefix), (step, n)
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        for n, p in model.named_parameters():
            changed = not torch.equal(before[n], p)
            assert changed == n.startswith(prefix), (step, n)
        held = {names[i] for i, p in enumerate(model.parameters()) if p in opt.state}
        # the state of the block that just switched away is gone
        if opt.active_block == active:
            assert held == {n for n in names if n.startswith(prefix)}
        else:
            assert held == set()
    assert [b for _, b in opt.switches] == [0, 1, 2, 0]
    assert [s for s, _ in opt.switches] == [0, 2, 4, 6]


@pytest.mark.parametrize("mode,expected", [("ascending", [0, 1, 2, 0, 1, 2, 0]),
                                           ("descending", [2, 1, 0, 2, 1, 0, 2])])
def test_switching_order_follows_the_mode(mode, expected):
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=1, switch_mode=mode, lr=1e-2)
    _train(model, opt, 6)
    assert [b for _, b in opt.switches] == expected


def test_random_mode_visits_every_block_once_per_pass():
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=1, switch_mode="random", seed=3,
                lr=1e-2)
    _train(model, opt, 8)
    order = [b for _, b in opt.switches]
    assert sorted(order[:3]) == [0, 1, 2] and sorted(order[3:6]) == [0, 1, 2]


def test_default_blocks_follow_layer_names():
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
             "model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.10.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    assert default_blocks(names) == [["model.embed_tokens."], ["model.layers.0."],
                                     ["model.layers.1."], ["model.layers.10."], ["model.norm."],
                                     ["lm_head."]]
    gpt2 = ["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight",
            "transformer.h.1.attn.c_attn.weight", "transformer.ln_f.weight"]
    assert default_blocks(gpt2) == [["transformer.wte."], ["transformer.h.0."],
                                    ["transformer.h.1."], ["transformer.ln_f."]]
    # a module holding a param beside submodules (Wav2Vec2's masked_spec_embed, BERT's
    # cls.predictions.bias): the param alone is the block, which covered every layer before
    w2v = ["enc.masked_spec_embed", "enc.layers.0.w", "enc.layers.1.w", "cls.predictions.bias",
           "cls.predictions.transform.dense.weight", "head.weight"]
    blocks = default_blocks(w2v)
    assert blocks == [["enc.masked_spec_embed"], ["enc.layers.0."], ["enc.layers.1."],
                      ["cls.predictions.bias"], ["cls.predictions.transform.dense."], ["head."]]
    for name in w2v:  # each param in exactly one block
        assert sum(any(_matches(name, p) for p in b) for b in blocks) == 1, name


def test_explicit_blocks_and_bad_arguments():
    model = _model()
    opt = BAdam(model.named_parameters(), blocks=[["0.", "2."], ["4."]], switch_block_every=5,
                lr=1e-2)
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, True, False,
                                                             False]
    with pytest.raises(ValueError, match="matches no parameter"):
        BAdam(model.named_parameters(), blocks=[["9."]])
    with pytest.raises(ValueError, match="switch_mode"):
        BAdam(model.named_parameters(), switch_mode="sideways")
    with pytest.raises(ValueError, match="switch_block_every"):
        BAdam(model.named_parameters(), switch_block_every=0)
    assert opt.inner.__class__ is fastllm.optim.AdamW


class _TopLevel(nn.Module):
    """Parameters at the top level (names without a dot) and 11 layers (layers.1 and layers.10)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.w2 = nn.Parameter(torch.randn(4))
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(11))


def test_prefixes_match_at_a_name_boundary():
    model = _TopLevel()
    names = [n for n, _ in model.named_parameters()]

    def members(opt):
        return [[names[i] for i in idx] for idx in opt.members]

    # by default, 'w' is a block of its own, not w and w2
    opt = BAdam(model.named_parameters(), lr=1e-2)
    assert opt.blocks[:3] == [["w"], ["w2"], ["layers.0."]]
    assert members(opt)[:2] == [["w"], ["w2"]]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["w"]
    opt = BAdam(model.named_parameters(), lr=1e-2,
                blocks=[["w", "layers.1"], ["layers.10."], ["w2", "layers.2.bias"], [""]])
    assert members(opt) == [["w", "layers.1.weight", "layers.1.bias"],
                            ["layers.10.weight", "layers.10.bias"], ["w2", "layers.2.bias"],
                            names]
    assert [n for n, p in model.named_parameters() if p.requires_grad] == members(opt)[0]
    with pytest.raises(ValueError, match="matches no parameter"):
        BAdam(model.named_parameters(), blocks=[["layer"]])


@pytest.mark.parametrize("mode", ["ascending", "random"])
@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_resume_switches_at_the_same_steps(mode, where):
    """Also from a state loaded onto the GPU (torch.load's map_location, accelerate's prepare:
    the schedule's generator state was refused there, a CPU generator takes a CPU tensor)."""
    a = _model()
    opt_a = BAdam(a.named_parameters(), switch_block_every=3, switch_mode=mode, lr=1e-2)
    _train(a, opt_a, 7)
    opt_a.skipped_steps = 2  # (as two inf steps leave it)
    blob = io.BytesIO()
    torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob, map_location=where)
    b = _model(seed=1)
    b.load_state_dict(saved["model"])
    opt_b = BAdam(b.named_parameters(), switch_block_every=3, switch_mode=mode, lr=1e-2)
    opt_b.load_state_dict(saved["opt"])
    assert opt_b.active_block == opt_a.active_block
    assert opt_b.skipped_steps == 2  # the count goes on from the checkpoint
    _train(a, opt_a, 10, start=7)
    _train(b, opt_b, 10, start=7)
    assert opt_a.switches == opt_b.switches
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_works_with_torch_optimizers_and_lr_schedulers():
    model = _model()
    opt = BAdam(model.named_parameters(), optimizer_class=torch.optim.SGD, switch_block_every=2,
                lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
        sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**2)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


def test_momentum_cycling_schedulers_find_the_inner_optimizers_betas():
    """OneCycleLR cycles betas[0] (cycle_momentum, its default): the outer optimizer carries
    the inner one's defaults for what was not passed, and the cycled betas reach it."""
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2)
    assert opt.param_groups[0]["betas"] == opt.inner.defaults["betas"]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=10)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()  # steps with the betas the scheduler set last
        assert opt.inner.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
        sched.step()
    assert opt.inner.param_groups[0]["betas"][0] not in (0.9, 0.95)  # cycled


def _ddp_check(rank, world):
    single = _model()
    opt_single = BAdam(single.named_parameters(), switch_block_every=2, lr=1e-2)
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2)
    for step in range(7):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        opt_single.zero_grad()
        (single(x) - y).square().mean().backward()
        opt_single.step()
        half = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        (ddp(x[half]) - y[half]).square().mean().backward()
        opt.step()
    return max(((a - b).abs().max() / b.abs().max()).item()
               for a, b in zip(model.parameters(), single.parameters()))


@pytest.fixture(scope="module")
def ddp_results():
    return spawn(_ddp_check, 2, timeout=180)


def test_ddp_matches_one_process(ddp_results):
    for worst in ddp_results:
        assert worst < 1e-5


def test_non_finite_step_is_a_no_op_and_options_pass_through():
    model = _model()
    scaler = fastllm.amp.LossScaler(init_scale=8.0, hysteresis=1)
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2, max_grad_norm=0.1,
                loss_scaler=scaler)
    opt.zero_grad()
    (_loss(model, 0) * 8.0).backward()
    opt.step()
    assert opt.global_step == 1 and 0 < float(opt.grad_norm)
    opt.zero_grad()
    (_loss(model, 1) * 8.0).backward()
    model[0].weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.step_skipped and opt.skipped_steps == 1
    assert opt.global_step == 1 and opt.active_block == 0  # the skipped step does not count
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert scaler.get_scale() == 4.0
    # the options are the inner AdamW's, not param-group hyperparameters saved in the state
    assert "loss_scaler" not in opt.state_dict()["hyperparameters"]
    bf16 = _model().to(torch.bfloat16)
    opt = BAdam(bf16.named_parameters(), lr=1e-2, master_weights=True)
    opt.zero_grad()
    bf16(torch.randn(8, 8).bfloat16()).float().square().mean().backward()
    opt.step()
    assert opt.inner.state[bf16[0].weight]["master_param"].dtype == torch.float32


def test_load_state_dict_checks_everything_before_changing_anything():
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2)
    _train(model, opt, 3)
    good = opt.state_dict()
    fresh = _model()
    other = BAdam(fresh.named_parameters(), switch_block_every=2, lr=1e-2)
    flags = [p.requires_grad for p in fresh.parameters()]
    for breakage in ("inner", "order", "position"):
        bad = dict(good)
        if breakage == "inner":
            bad["inner"] = {"state": {0: {"step": torch.tensor(1.0)}},
                            "param_groups": [dict(good["inner"]["param_groups"][0],
                                                  params=[0, 1, 2])]}
        elif breakage == "order":
            bad["order"] = [0, 0, 1]
        else:
            bad["position"] = 7
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
        assert other.global_step == 0 and other.active_block == 0
        assert [p.requires_grad for p in fresh.parameters()] == flags
    other.load_state_dict(good)
    assert other.global_step == 3 and other.active_block == opt.active_block
    with pytest.raises(ValueError, match="blocks must be a non-empty list"):
        BAdam(model.named_parameters(), blocks=[])
    with pytest.raises(ValueError, match="blocks must be a non-empty list"):
        BAdam(model.named_parameters(), blocks=["0."])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_steps_on_as_the_original(how):
    """copy.deepcopy and torch.save/torch.load of BAdam (with its model) carry the inner
    optimizer and the schedule: the copy's next steps and switches are the original's."""
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2, switch_mode="random")
    _train(model, opt, 3)
    if how == "deepcopy":
        import copy

        model2, opt2 = copy.deepcopy((model, opt))
    else:
        blob = io.BytesIO()
        torch.save((model, opt), blob)
        blob.seek(0)
        model2, opt2 = torch.load(blob, weights_only=False)
    _train(model, opt, 5, start=3)
    _train(model2, opt2, 5, start=3)
    assert opt2.switches == opt.switches
    for pa, pb in zip(model.parameters(), model2.parameters()):
        assert torch.equal(pa, pb)


def test_state_dict_hooks_run_as_torch_runs_them():
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook: called
    where torch.optim.Optimizer calls them; what a post-hook or load pre-hook returns is used."""
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=2, lr=1e-2)
    _train(model, opt, 1)
    log = []
    opt.register_state_dict_pre_hook(lambda o: log.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: dict(sd, tag="post"))
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: log.append(("load_pre", sd.pop("tag"))) or dict(sd, global_step=7))
    opt.register_load_state_dict_post_hook(lambda o: log.append(("load_post", o.global_step)))
    saved = opt.state_dict()
    assert saved["tag"] == "post"
    opt.load_state_dict(saved)
    assert "tag" in saved  # the pre-hooks edit a copy
    assert log == ["pre", ("load_pre", "post"), ("load_post", 7)]
    assert opt.global_step == 7


def test_add_param_group_after_construction_is_refused():
    """BAdam takes its blocks from the named parameters at construction: a group added later
    was accepted and its params never trained."""
    model = _model()
    opt = BAdam(model.named_parameters(), switch_block_every=1, lr=1e-2)
    assert len(opt.param_groups) == 1  # (torch's __init__ adds the first group through it)
    with pytest.raises(RuntimeError, match="BAdam does not support add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(3))], "lr": 0.1})
    assert len(opt.param_groups) == 1
    _loss(model, 0).backward()
    opt.step()

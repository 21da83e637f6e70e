"""fastllm.optim.BAdam: block-coordinate training (Luo et al. 2024, arXiv:2404.02827): only one
block of parameters trains at a time, so only that block needs gradients and optimizer state.

    opt = fastllm.optim.BAdam(model.named_parameters(), lr=1e-4, switch_block_every=100,
                              switch_mode="ascending")

`blocks` is a list of blocks, each a list of parameter-name prefixes (the badam package's
`block_prefix_list`), matched at a name boundary: a prefix takes the parameter of that name and
every one under it ('model.layers.1' and 'model.layers.1.' take model.layers.1.*, not
model.layers.10.*; 'w' takes w, not w2); the empty prefix takes every parameter. By default
there is one block per transformer layer found by name (`...layers.N.`, `...h.N.`,
`...layer.N.`, `...blocks.N.`, or `N.` for a top-level nn.Sequential), and every other module
(embeddings, final norm, head) is a block of its own, in the order the names come. Parameters
that match no block never train.

Only the active block has requires_grad=True and an inner optimizer (optimizer_class, default
fastllm.optim.AdamW, built with **optimizer_kwargs); every `switch_block_every` steps the inner
optimizer and its state are dropped, the old block's grads freed, and the next block activated:
in index order ("ascending"), reverse order ("descending"), or a fresh random order of all blocks
each pass ("random", from a generator seeded by `seed`). `state_dict()` holds the inner
optimizer's state, the step count and the block schedule (order, position, generator), so a
resumed run switches at the same steps to the same blocks.

Under DDP, build the model's DDP with find_unused_parameters=True (the inactive blocks get no
gradient); every rank follows the same schedule.

With the default inner optimizer, fastllm.optim.AdamW's options pass through: max_grad_norm
(clipping by the active block's grad norm, the only grads there are), loss_scaler (a
fastllm.amp.LossScaler, kept across block switches), master_weights (fp32 masters of bf16/fp16
params; a block's master is rebuilt from its param when the block comes back, as its moments
are). A step with inf/nan grads is a no-op, as in AdamW, and does not count towards
switch_block_every; `grad_norm`, `step_skipped` and `skipped_steps` report it.
"""

import re

import torch

__all__ = ["BAdam", "default_blocks"]

_MODES = ("ascending", "descending", "random")
# Inner-optimizer options that are not param-group hyperparameters (objects, flags).
_OPTIONS = ("master_weights", "max_grad_norm", "loss_scaler", "stochastic_rounding",
            "kahan_summation", "state_dtype")
_LAYER = re.compile(r"^(.*?(?:^|\.)(?:layers|h|layer|blocks)\.\d+\.)|^(\d+\.)")


def _matches(name, prefix):
    """Whether the parameter `name` is `prefix` or lies under it (see the module docstring)."""
    if not prefix or prefix.endswith("."):
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def default_blocks(names):
    """One block (a list of one name prefix) per layer found in `names`, one per other module;
    no two blocks share a parameter. A parameter held by a module beside its submodules
    (Wav2Vec2's masked_spec_embed next to its layers, BERT's cls.predictions.bias next to its
    transform) is a block of its own: its module's prefix would cover the submodules too."""
    names = list(names)
    blocks, seen = [], set()
    for name in names:
        m = _LAYER.match(name)
        prefix = (m.group(1) or m.group(2)) if m else (name.rsplit(".", 1)[0] + "."
                                                        if "." in name else name)
        if not m and prefix.endswith(".") and any(
                other.startswith(prefix) and "." in other[len(prefix):] for other in names):
            prefix = name
        if prefix not in seen:
            seen.add(prefix)
            blocks.append([prefix])
    return blocks


class BAdam(torch.optim.Optimizer):
    """Block-coordinate optimizer: see the module docstring.

    Args:
        named_parameters: iterable of (name, param), e.g. model.named_parameters().
        optimizer_class: the inner optimizer for the active block (default fastllm AdamW).
        switch_block_every: steps per block (> 0).
        switch_mode: "ascending", "descending" or "random".
        blocks: list of lists of name prefixes, matched at a '.' boundary, or None for the
            default (see default_blocks).
        start_block: index of the first block (default: the first of the order).
        seed: seeds the "random" order.
        no_decay: names of parameters trained without weight decay (biases and norm weights, as
            Hugging Face's Trainer excludes them): each block's inner optimizer puts them in a
            group of their own with weight_decay 0.
        **optimizer_kwargs: passed to optimizer_class (lr, betas, weight_decay, ...).
    """

    def __init__(self, named_parameters, optimizer_class=None, switch_block_every=100,
                 switch_mode="ascending", blocks=None, *, start_block=None, seed=0,
                 no_decay=(), **optimizer_kwargs):
        if optimizer_class is None:
            from fastllm.optim.adamw import AdamW as optimizer_class
        named = list(named_parameters)
        if not named or not all(isinstance(n, tuple) and len(n) == 2 for n in named):
            raise TypeError("fastllm.optim.BAdam: expected a non-empty iterable of (name, param) "
                            "pairs, e.g. model.named_parameters()")
        if not (isinstance(switch_block_every, int) and switch_block_every >= 1):
            raise ValueError(f"fastllm.optim.BAdam: switch_block_every must be an int >= 1, got "
                             f"{switch_block_every!r}")
        if switch_mode not in _MODES:
            raise ValueError(f"fastllm.optim.BAdam: switch_mode {switch_mode!r} is not one of "
                             f"{_MODES}")
        names = [n for n, _ in named]
        if blocks is not None:
            blocks = list(blocks)
            if not blocks or not all(isinstance(b, (list, tuple)) and b
                                     and all(isinstance(pre, str) for pre in b) for b in blocks):
                raise ValueError(f"fastllm.optim.BAdam: blocks must be a non-empty list of "
                                 f"non-empty lists of parameter-name prefixes, got {blocks!r}")
        blocks = default_blocks(names) if blocks is None else [list(b) for b in blocks]
        members = [[i for i, n in enumerate(names) if any(_matches(n, pre) for pre in block)]
                   for block in blocks]
        for bi, (block, idx) in enumerate(zip(blocks, members)):
            if not idx:
                raise ValueError(f"fastllm.optim.BAdam: block {bi} {block} matches no parameter")
        if start_block is not None and not 0 <= start_block < len(blocks):
            raise ValueError(f"fastllm.optim.BAdam: start_block {start_block} is not a block "
                             f"index (0..{len(blocks) - 1})")
        unknown = sorted(set(no_decay) - set(names))
        if unknown:
            raise ValueError(f"fastllm.optim.BAdam: no_decay names parameters that are not "
                             f"given: {unknown[:5]}")
        self._no_decay = {i for i, n in enumerate(names) if n in set(no_decay)}
        self.names = names
        self.blocks = blocks
        self.members = members
        self.optimizer_class = optimizer_class
        self.optimizer_kwargs = optimizer_kwargs
        self.switch_block_every = switch_block_every
        self.switch_mode = switch_mode
        self.generator = torch.Generator().manual_seed(seed)
        self.global_step = 0
        self.switches = []  # (step, block) of every activation, for inspection and tests
        self.skipped_steps = 0
        self.grad_norm = None  # the last step's (the inner optimizer's, of the active block)
        self.step_skipped = False
        super().__init__([p for _, p in named],
                         {k: v for k, v in optimizer_kwargs.items() if k not in _OPTIONS})
        self._order = self._new_order()
        self._position = 0
        if start_block is not None:
            self._position = self._order.index(start_block)
        self.inner = None
        self._activate()
        # The inner optimizer's defaults for what was not passed (betas, eps, ...), so that what
        # a scheduler reads here exists (OneCycleLR and CyclicLR cycle betas[0]).
        for key, value in self.inner.defaults.items():
            if key not in _OPTIONS:
                self.defaults.setdefault(key, value)
                self.param_groups[0].setdefault(key, value)

    @property
    def active_block(self):
        return self._order[self._position]

    def _new_order(self):
        n = len(self.blocks)
        if self.switch_mode == "ascending":
            return list(range(n))
        if self.switch_mode == "descending":
            return list(range(n - 1, -1, -1))
        return torch.randperm(n, generator=self.generator).tolist()

    def _params(self):
        return self.param_groups[0]["params"]

    def _new_inner(self, block):
        """(a new inner optimizer for `block`, the indices of its groups that keep weight_decay
        0 when the outer group's is synced into them); changes nothing here (load_state_dict
        builds one it may refuse)."""
        params = self._params()
        idx = sorted(self.members[block])
        decay = [params[i] for i in idx if i not in self._no_decay]
        plain = [params[i] for i in idx if i in self._no_decay]
        groups = ([{"params": decay}] if decay else []) + \
            ([{"params": plain, "weight_decay": 0.0}] if plain else [])
        no_decay = {len(groups) - 1} if plain else set()
        return self.optimizer_class(groups, **self.optimizer_kwargs), no_decay

    def _activate(self, inner=None, record=True):
        """Make the active block trainable (the others frozen, their grads freed) with a new
        inner optimizer, or `inner` (_new_inner's pair, already built and loaded for that
        block)."""
        params = self._params()
        active = set(self.members[self.active_block])
        for i, p in enumerate(params):
            p.requires_grad_(i in active)
            if i not in active:
                p.grad = None
        self.inner, self._inner_no_decay = (inner if inner is not None
                                            else self._new_inner(self.active_block))
        self._sync_hyperparameters()
        if record:
            self.switches.append((self.global_step, self.active_block))

    def _switch(self):
        self.inner = None  # drops the old block's optimizer state
        self._position += 1
        if self._position == len(self._order):
            self._order = self._new_order()
            self._position = 0
        self._activate()

    def _sync_hyperparameters(self):
        """Copy lr etc. (which an LR scheduler sets on this optimizer) into the inner one."""
        for gi, group in enumerate(self.inner.param_groups):
            for key, value in self.param_groups[0].items():
                if key != "params" and key in group and not (
                        key == "weight_decay" and gi in self._inner_no_decay):
                    group[key] = value

    @torch.no_grad()
    def step(self, closure=None):
        """One step of the active block's optimizer; switches block every switch_block_every."""
        self._sync_hyperparameters()
        loss = self.inner.step(closure)
        # read before a switch drops the inner optimizer
        self.grad_norm = getattr(self.inner, "grad_norm", None)
        self.step_skipped = bool(getattr(self.inner, "step_skipped", False))
        if self.step_skipped:  # inf/nan: the inner step changed nothing, nor does the schedule
            self.skipped_steps += 1
            return loss
        self.global_step += 1
        if self.global_step % self.switch_block_every == 0:
            self._switch()
        return loss

    def add_param_group(self, param_group):
        """torch.optim.Optimizer.__init__ adds the one group of every named parameter through
        this; any group after that is refused: the blocks, and the params each trains, were
        taken from the named parameters at construction, so a group's params would never
        train."""
        if getattr(self, "param_groups", None):
            raise RuntimeError("fastllm.optim.BAdam does not support add_param_group: its blocks "
                               "are taken from the named parameters given at construction; "
                               "build a new BAdam over all the parameters to train")
        super().add_param_group(param_group)

    def __getstate__(self):
        """All attributes (the inner optimizer, the schedule) but torch's hooks (torch's own
        __getstate__ leaves them behind too): a deep copy or a pickle steps on as it would."""
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none)

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    @state.setter
    def state(self, value):
        pass  # torch.optim.Optimizer.__init__ assigns an empty state; the inner one is used

    def state_dict(self):
        """The inner optimizer's state_dict, the schedule and the step count. The state-dict
        hooks run as torch runs them: the pre-hooks first, the post-hooks on the whole of it
        (what they return replaces it)."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state_dict = {
            "inner": self.inner.state_dict(),
            "hyperparameters": {k: v for k, v in self.param_groups[0].items() if k != "params"},
            "global_step": self.global_step,
            "order": list(self._order),
            "position": self._position,
            "generator": self.generator.get_state(),
            "blocks": [list(b) for b in self.blocks],
            "switch_block_every": self.switch_block_every,
            "switch_mode": self.switch_mode,
            "switches": list(self.switches),
            "skipped_steps": int(self.skipped_steps),
        }
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        """Restore a state_dict() of a BAdam over the same parameters and blocks. Everything is
        checked first, the inner state by loading it into a new inner optimizer of the block
        it names; only then do the step count, schedule and requires_grad change. The
        load-state-dict hooks run as torch runs them: what the pre-hooks return is what is
        checked and loaded; the post-hooks run once it is loaded."""
        where = "fastllm.optim.BAdam.load_state_dict"
        if isinstance(state_dict, dict):
            state_dict = state_dict.copy()  # (shallow, as torch's: the pre-hooks may edit it)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        keys = ("inner", "hyperparameters", "global_step", "order", "position", "generator",
                "blocks", "switch_block_every", "switch_mode", "switches")
        missing = [k for k in keys if not isinstance(state_dict, dict) or k not in state_dict]
        if missing:
            raise ValueError(f"{where}: the state_dict lacks {missing}")
        for key in ("blocks", "switch_block_every", "switch_mode"):
            if state_dict[key] != getattr(self, key):
                raise ValueError(f"fastllm.optim.BAdam: the state_dict has {key} "
                                 f"{state_dict[key]!r}, this optimizer {getattr(self, key)!r}")
        n = len(self.blocks)
        order, position, step = state_dict["order"], state_dict["position"], state_dict[
            "global_step"]
        if sorted(order) != list(range(n)):
            raise ValueError(f"{where}: order {order!r} is not a permutation of the {n} blocks")
        if not (isinstance(position, int) and 0 <= position < n):
            raise ValueError(f"{where}: position {position!r} is not in 0..{n - 1}")
        if not (isinstance(step, int) and step >= 0):
            raise ValueError(f"{where}: global_step {step!r} is not an int >= 0")
        skipped = state_dict.get("skipped_steps", 0)  # (absent from states saved before it)
        if not (isinstance(skipped, int) and skipped >= 0):
            raise ValueError(f"{where}: skipped_steps {skipped!r} is not an int >= 0")
        rng = state_dict["generator"]
        # (accelerate's prepare and a GPU map_location move the state's tensors to the device;
        # a CPU generator takes a CPU byte tensor)
        rng = rng.cpu() if isinstance(rng, torch.Tensor) else rng
        generator = torch.Generator()
        try:
            generator.set_state(rng)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"{where}: the generator state is invalid: {e}") from None
        inner = self._new_inner(order[position])
        inner[0].load_state_dict(state_dict["inner"])  # raises here, before anything changed
        self.param_groups[0].update(state_dict["hyperparameters"])
        self.global_step = step
        self._order = list(order)
        self._position = position
        self.generator.set_state(rng)
        self.switches = list(state_dict["switches"])
        self.skipped_steps = skipped
        self._activate(inner, record=False)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

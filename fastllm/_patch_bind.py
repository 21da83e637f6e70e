"""How fastllm.patch swaps a module's forward: the replacement bound to the module instance.

The swap is a bound method (types.MethodType of the replacement function and the module) in the
instance's __dict__. A bound method is what dynamo guards by its function: a monkeypatched
instance forward of any other kind (a functools.partial, a callable object) is guarded by its
identity (torch/_dynamo/variables/nn_module.py, guard_to_detect_forward_monkeypatching), so with
a partial per module each decoder layer compiled again under per-block compile (torchtitan's
`layer.compile()` for every layer: ten layers ran past dynamo's recompile limit of 8, the rest
eagerly); bound methods give the layers one graph.

A bound method pickles as `getattr(module, name)`, which unpickling cannot resolve, so a patched
module carries its own `__reduce_ex__` (pickle and copy look it up on the instance, where it
shadows object's): the module's usual state with each of fastllm's bound methods as a call that
binds it again to the unpickled module (already made, its state not yet set: binding needs none).
"""

import copyreg
import functools
import types

_REDUCE = "__reduce_ex__"

# the functions bind() binds (and _reduce, bound too): the reduce turns them into rebinding calls
_BOUND = set()


def is_ours(f, module, replacements):
    """Whether `f` is one of `replacements` bound to `module` by bind(); or a functools.partial
    of one over the module, as fastllm bound them before 2026-12-07 (a model pickled then)."""
    if type(f) is types.MethodType:
        return f.__self__ is module and f.__func__ in replacements
    return (isinstance(f, functools.partial) and f.func in replacements
            and len(f.args) == 1 and f.args[0] is module and not f.keywords)


def bind(module, slot, fn):
    """Set `module.<slot>` to `fn` bound to the module, and the module's pickling to match."""
    _BOUND.add(fn)
    setattr(module, slot, types.MethodType(fn, module))
    if _REDUCE not in module.__dict__:
        module.__dict__[_REDUCE] = types.MethodType(_reduce, module)


def unbind(module):
    """After the last swap of `module` is undone: its pickling back to the class's."""
    module.__dict__.pop(_REDUCE, None)


def rebind(fn, module):
    """Unpickling of a bound method that bind() made (module-level, for pickle to name)."""
    return types.MethodType(fn, module)


class _Rebind:
    """A bound method of bind()'s in a pickled state: unpickles (and deep-copies) as
    rebind(fn, module). copy.copy keeps it as it is, in the copy's state: called, it runs fn on
    the module it came from, as the bound method would have."""

    __slots__ = ("fn", "module")

    def __init__(self, fn, module):
        self.fn, self.module = fn, module

    def __reduce__(self):
        return rebind, (self.fn, self.module)

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)


def _reduce(module, protocol):
    # object.__reduce_ex__'s answer for a module (protocol 2 and up: torch.save's and copy's),
    # with its state from nn.Module.__getstate__ and fastllm's bound methods made picklable
    state = {
        key: _Rebind(value.__func__, module)
        if type(value) is types.MethodType and value.__self__ is module
        and value.__func__ in _BOUND else value
        for key, value in module.__getstate__().items()}
    return copyreg.__newobj__, (type(module),), state


_BOUND.add(_reduce)

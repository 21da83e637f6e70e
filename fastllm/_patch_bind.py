"""How fastllm.patch swaps a module's forward: the replacement bound to the module instance.

The swap is a bound method (types.MethodType of the replacement function and the module) in the
instance's __dict__. A bound method is what dynamo guards by its function: a monkeypatched
instance forward of any other kind (a functools.partial, a callable object) is guarded by its
identity (torch/_dynamo/variables/nn_module.py, guard_to_detect_forward_monkeypatching), so with
a partial per module each decoder layer compiled again under per-block compile (torchtitan's
`layer.compile()` for every layer: ten layers ran past dynamo's recompile limit of 8, the rest
eagerly); bound methods give the layers one graph.

A bound method pickles as `getattr(module, name)`, which cannot resolve on unpickling (the
replacement is no attribute of the module's class). So fastllm registers a reducer for bound
methods with copyreg (as torch does for its own types): the methods bind() made pickle as a call
that binds the function again to the unpickled module (made before its state, which binding
does not need); every other bound method as Python's own reduction does (or as a reducer
registered before fastllm's does). copy.deepcopy binds methods again itself (copy's own rule).
"""

import copyreg
import functools
import types

# the functions bind() binds: the bound methods the reducer below makes picklable
_BOUND = set()


def is_ours(f, module, replacements):
    """Whether `f` is one of `replacements` bound to `module` by bind(); or a functools.partial
    of one over the module, as fastllm bound them before 2026-12-07 (a model pickled then)."""
    if type(f) is types.MethodType:
        return f.__self__ is module and f.__func__ in replacements
    return (isinstance(f, functools.partial) and f.func in replacements
            and len(f.args) == 1 and f.args[0] is module and not f.keywords)


def bind(module, slot, fn):
    """Set `module.<slot>` to `fn` (a module-level function) bound to the module."""
    _BOUND.add(fn)
    setattr(module, slot, types.MethodType(fn, module))


def rebind(fn, module):
    """Unpickling of a bound method that bind() made (module-level, for pickle to name)."""
    return types.MethodType(fn, module)


# (another library's reducer, or this module's before a reload: chained to)
_PREVIOUS = copyreg.dispatch_table.get(types.MethodType)


def _reduce_method(method):
    if method.__func__ in _BOUND:
        return rebind, (method.__func__, method.__self__)
    return _PREVIOUS(method) if _PREVIOUS is not None else method.__reduce__()


copyreg.pickle(types.MethodType, _reduce_method)

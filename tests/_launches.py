"""Counting a Triton kernel's launches in a test, on every Triton release fastllm supports.

A launch is `kernel[grid](...)`. Patching the kernel's `run` counts nothing under the interpreter
of Triton 3.3 and older (its `kernel[grid]` calls the interpreted function without going through
`run`), so the kernel's module global is replaced by a proxy that counts each `kernel[grid](...)`.
Launchers must look the kernel up in their module at launch time (they all do).
"""


class _Counted:
    def __init__(self, kernel, calls):
        self._kernel, self._calls = kernel, calls

    def __getitem__(self, grid):
        launch = self._kernel[grid]

        def counted(*args, **kwargs):
            self._calls.append(grid)
            return launch(*args, **kwargs)

        return counted

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def count_launches(monkeypatch, module, name):
    """A list that grows by one (the grid) at each launch of `module.name` until the test ends."""
    calls = []
    monkeypatch.setattr(module, name, _Counted(getattr(module, name), calls))
    return calls

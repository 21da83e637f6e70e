"""Refusing tensor arguments that share memory where an op writes (torch's in-place ops refuse
the same: "some elements of the input tensor and the written-to tensor refer to a single memory
location"). The C++ and Triton kernels read and write raw memory in parallel and declare their
pointers unaliased, so an aliased argument gives numbers that follow the schedule (an exp_avg
that is also the exp_avg_sq made the cpp AdamW write nan where the reference did not).

Real tensors only (their data pointers): an op calls it in its implementation, outside a step
its caller has already checked (fastllm._backend.prevalidated), never in its fake."""


def _extent(t):
    """The bytes from t's first element to one past its last (any non-negative strides)."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (last + 1) * t.element_size()


def refuse_overlap(op, written, read=(), hint="clone() one of them first"):
    """Raise ValueError naming two arguments that share memory: a written tensor and any other
    argument. written, read: iterables of (label, tensor or None); a tensor may be read by any
    number of arguments. Reads one pointer per tensor; the spans are swept in address order."""
    spans = []
    for kind, items in (("written", written), ("read", read)):
        for label, t in items:
            if t is not None and t.numel() > 0:
                start = t.data_ptr()
                spans.append((start, start + _extent(t), kind, label))
    spans.sort(key=lambda s: (s[0], s[1]))
    furthest = {"written": (0, None), "read": (0, None)}  # the furthest end so far, and whose
    for start, end, kind, label in spans:
        for other in ("written", "read") if kind == "written" else ("written",):
            if start < furthest[other][0]:
                raise ValueError(f"{op}: {label} and {furthest[other][1]} share memory; {hint}")
        if end > furthest[kind][0]:
            furthest[kind] = (end, label)


def labelled(**lists):
    """(label, tensor) pairs of lists of tensors, each tensor as `name[i]`."""
    return [(f"{name}[{i}]", t) for name, tensors in lists.items()
            for i, t in enumerate(tensors or ())]

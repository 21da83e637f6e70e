"""The policy layer against PyTorch's own behaviour: autocast's casts (fastllm.linear as F.linear,
fastllm.attention as F.scaled_dot_product_attention, on CPU and CUDA) and Triton's reading of
TRITON_INTERPRET."""

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm import _backend, _lowp
from fastllm.ops.attention import attention
from fastllm.ops.linear import linear


def _sdpa(q, k, v):
    """F.scaled_dot_product_attention in attention's (B, T, H, D) layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def _rel_err(got, oracle):
    return ((got.double() - oracle).abs().max() / oracle.abs().max()).item()


@pytest.mark.parametrize("bias", [False, True])
def test_linear_under_autocast_leaves_fp64_alone(bias):
    """CPU autocast casts fp32/fp16 arguments of F.linear to its dtype but never fp64 ones."""
    x, w = torch.randn(3, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    b = torch.randn(5, dtype=torch.float64) if bias else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, theirs = linear(x, w, b), F.linear(x, w, b)
    assert got.dtype == theirs.dtype == torch.float64
    torch.testing.assert_close(got, theirs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.bfloat16, torch.float32,
                                                          torch.float32), (torch.float64,) * 3])
def test_attention_under_autocast_casts_like_sdpa(dtypes):
    """fp32 (or mixed fp32/bf16) q, k, v under CPU autocast: bf16 out, as sdpa gives; fp64 is
    left alone by both."""
    q = torch.randn(2, 5, 4, 8, dtype=dtypes[0])
    k, v = (torch.randn(2, 5, 2, 8, dtype=dt) for dt in dtypes[1:])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, theirs = attention(q, k, v), _sdpa(q, k, v)
    assert got.dtype == theirs.dtype
    oracle = _sdpa(*(t.to(theirs.dtype).double() for t in (q, k, v)))
    assert _rel_err(got, oracle) <= 2 * max(_rel_err(theirs, oracle), 1e-7)


@pytest.mark.parametrize("backend", ["ref", "cpp"])
def test_attention_op_under_autocast_still_computes_in_fp32(backend):
    """The op computes in fp32 whatever autocast says around it: the reference's products must
    not be run in bf16 by an enclosing autocast (its error would be bf16's, ~1e-3)."""
    if _backend.unavailable_reason(backend, "cpu"):
        pytest.skip(_backend.unavailable_reason(backend, "cpu"))
    q, k, v = torch.randn(1, 33, 4, 16), torch.randn(1, 33, 2, 16), torch.randn(1, 33, 2, 16)
    oracle = _sdpa(q.double(), k.double(), v.double())
    with fastllm.use_backend(backend), torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = torch.ops.fastllm.attention(q, k, v, None, 16 ** -0.5)
    assert out.dtype == torch.float32
    assert _rel_err(out, oracle) < 1e-5
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    with fastllm.use_backend(backend):
        plain = attention(qb, kb, vb)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cast = attention(qb, kb, vb)
    torch.testing.assert_close(cast, plain, rtol=0, atol=0)


def test_autocast_args_casts_what_aten_autocast_casts():
    """autocast_args(device_type, ...): floating tensors of that device type to its autocast
    dtype; None, fp64, integer tensors and tensors of another device type as they are."""
    f32, f16 = torch.randn(3), torch.randn(3, dtype=torch.float16)
    f64, i64 = torch.randn(3, dtype=torch.float64), torch.arange(3)
    for dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", dtype=dtype):
            a, b, c, d, e = _lowp.autocast_args("cpu", f32, f16, f64, i64, None)
            assert _lowp.autocast_enabled("cpu")
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a.float(), f32.to(dtype).float())
        assert c is f64 and d is i64 and e is None
    # CPU tensors are not CUDA autocast's to cast (is_autocast_eligible), nor the reverse
    assert all(x is y for x, y in zip(_lowp.autocast_args("cuda", f32, f16), (f32, f16)))
    assert not _lowp.autocast_enabled("cpu")
    assert not _lowp.autocast_enabled("meta")  # torch.is_autocast_enabled("meta") raises


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA autocast needs a GPU"))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["linear", "attention", "packed_attention"])
def test_autocast_on_the_inputs_device_casts_like_pytorch(device, dtype, op):
    """Under torch.autocast(device) fp32 inputs (and a bf16 one among them) give what F.linear /
    sdpa give there: their dtype, and an error against the fp64 result of the cast inputs at
    most twice theirs. On CUDA only CPU autocast was read before: the mixed dtypes were refused
    and fp32 ones computed in fp32. packed_attention: one document per row (doc_start 0), the
    causal attention again, through the varlen route on a GPU that has it."""
    if op == "linear":
        args = [torch.randn(7, 33, device=device), torch.randn(17, 33, device=device),
                torch.randn(17, device=device, dtype=torch.bfloat16)]
        ours, theirs_fn = linear, F.linear
    else:
        args = [torch.randn(2, 37, 4, 16, device=device),
                torch.randn(2, 37, 2, 16, device=device, dtype=torch.bfloat16),
                torch.randn(2, 37, 2, 16, device=device)]
        doc_start = (torch.zeros(2, 37, dtype=torch.int64, device=device)
                     if op == "packed_attention" else None)

        def ours(q, k, v):
            return attention(q, k, v, doc_start=doc_start)

        theirs_fn = _sdpa
    with torch.autocast(device, dtype=dtype):
        got, theirs = ours(*args), theirs_fn(*args)
    assert got.dtype == theirs.dtype == dtype
    oracle = theirs_fn(*(t.to(dtype).double() for t in args))
    assert _rel_err(got, oracle) <= 2 * max(_rel_err(theirs, oracle), 1e-7)


@pytest.mark.parametrize("value", ["true", "ON", "yes"])
def test_triton_interpret_spelled_as_triton_reads_it(monkeypatch, value):
    """Triton takes TRITON_INTERPRET=true/on/yes (any case) as set; so must the backend choice,
    or a forced triton backend on CPU is refused for a reason that is not so."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert _backend.triton_interpreting()
    assert _backend.unavailable_reason("triton", "cpu") is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not _backend.triton_interpreting()
    assert "TRITON_INTERPRET" in _backend.unavailable_reason("triton", "cpu")


def test_triton_interpret_set_after_import_is_named(monkeypatch):
    """TRITON_INTERPRET set after `import fastllm` (which imports triton.language through
    torch._dynamo, its functions then made for the GPU): Triton failed on CPU tensors with
    "Cannot call @triton.jit'd outside of the scope of a kernel"; it is refused saying why."""
    pytest.importorskip("triton")
    monkeypatch.setattr(_backend, "_INTERPRETING_AT_IMPORT", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "set after import" in _backend.unavailable_reason("triton", "cpu")


def test_empty_policy_variables_are_unset_and_linear_checks_the_backend_name(monkeypatch):
    """An empty FASTLLM_CPU_* value (a bare `ENV X=` line) is unset, as an empty FASTLLM_BACKEND
    is (it was refused); fastllm.ops.linear, one implementation for every backend, still refuses
    a misspelt FASTLLM_BACKEND as the other ops do (it ran on)."""
    x, w = torch.randn(2, 3), torch.randn(4, 3)
    for name in ("FASTLLM_CPU_FP32_MATMUL", "FASTLLM_CPU_LOWP_MATMUL", "FASTLLM_CPU_ATTENTION"):
        monkeypatch.setenv(name, "")
    torch.testing.assert_close(linear(x, w), x @ w.t())
    monkeypatch.setenv("FASTLLM_BACKEND", "CPP")
    with pytest.raises(ValueError, match="FASTLLM_BACKEND='CPP' is not one of"):
        linear(x, w)

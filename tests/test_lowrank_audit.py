"""Audit of GaLore and PowerSGD against their references (galore-torch's GaLoreProjector, torch's
powerSGD_hook): GaLore's projector stays orthonormal, as galore-torch's SVD is, when the
gradient at a refresh is zero or of lower rank than the projection; PowerSGD draws the seeded
first Q from the same stream as torch's hook when a bucket compresses nothing.

Tolerances: orthonormality in fp32 to 1e-5 (Gram-Schmidt on well-separated columns reaches a
few 1e-7); against torch's hook 1e-4 of the gradient's scale, as tests/test_powersgd.py.
"""

import pytest
import torch

from fastllm.distributed import PowerSGD
from fastllm.distributed.launch import spawn
from fastllm.optim import GaLoreAdamW
from fastllm.optim.galore import range_finder


# --- GaLore ---------------------------------------------------------------------------------
@pytest.mark.parametrize("proj_type", ["std", "reverse_std"])
def test_galore_zero_first_gradient_does_not_freeze_the_matrix(proj_type):
    # A zero gradient at the first refresh (a zero-initialised layer downstream, a fully masked
    # first batch): galore-torch's SVD still gives an orthonormal projector and the matrix
    # trains from the next step on; a zero projector would stay zero at every warm start.
    torch.manual_seed(0)
    w = torch.randn(16, 32, requires_grad=True)
    w0 = w.detach().clone()
    opt = GaLoreAdamW([{"params": [w], "rank": 4, "update_proj_gap": 2,
                        "proj_type": proj_type}], lr=0.1)
    for step in range(5):
        w.grad = torch.zeros(16, 32) if step == 0 else torch.randn(16, 32)
        opt.step()
        p = opt.state[w]["projector"]
        torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    assert (w.detach() - w0).abs().max() > 1e-2


def test_galore_projector_is_orthonormal_for_a_rank_deficient_gradient():
    # Rank 2 with rank 4 requested: the two extra columns must complete the basis (as the SVD's
    # U[:, :4] does), not repeat the first two, which would double the update along them.
    g = torch.zeros(16, 32)
    g[:2] = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
    p = range_finder(g, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)
    u = torch.linalg.svd(g.double()).U[:, :2]
    assert (u - p.double() @ (p.double().t() @ u)).norm() < 1e-5  # the range is still kept

    # The optimizer's projector is the same.
    w = torch.zeros(16, 32, requires_grad=True)
    opt = GaLoreAdamW([{"params": [w], "rank": 4, "scale": 1.0}], lr=0.1)
    w.grad = g.clone()
    opt.step()
    p = opt.state[w]["projector"]
    torch.testing.assert_close(p.t() @ p, torch.eye(4), rtol=0, atol=1e-5)


# --- PowerSGD in a world-2 Gloo launch --------------------------------------------------------
class _Bucket:
    """What a comm hook reads from torch.distributed.GradBucket."""

    def __init__(self, buffer, shapes, index, last):
        self._buffer, self._index, self._last = buffer, index, last
        self._grads, offset = [], 0
        for s in shapes:
            n = torch.Size(s).numel()
            self._grads.append(buffer[offset:offset + n].view(s))
            offset += n

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def index(self):
        return self._index

    def is_last(self):
        return self._last


# Bucket 0 holds only vectors (biases, norms: DDP's small first bucket), bucket 1 matrices.
_BUCKETS = [[(32,), (5,)], [(64, 32), (16, 48)]]


def _against_torch(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState,
                                                                            powerSGD_hook)
    out = {}
    for warm_start in (True, False):
        ours = PowerSGD(rank=4, start_iter=2, warm_start=warm_start)
        theirs = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                               warm_start=warm_start)
        worst = 0.0
        for step in range(5):
            for k, shapes in enumerate(_BUCKETS):
                n = sum(torch.Size(s).numel() for s in shapes)
                a = torch.randn(n, generator=torch.Generator().manual_seed(100 * step + rank))
                b = a.clone()
                last = k == len(_BUCKETS) - 1
                ours.reduce_(a, _Bucket(a, shapes, k, last).gradients(), k, last)
                powerSGD_hook(theirs, _Bucket(b, shapes, k, last)).wait()
                worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
        out[warm_start] = worst
    return out


@pytest.fixture(scope="module")
def world2():
    return spawn(_against_torch, 2, timeout=120)


def test_powersgd_bucket_without_matrices_keeps_torchs_seeded_first_q(world2):
    for result in world2:
        for warm_start, worst in result.items():
            assert worst < 1e-4, (warm_start, worst)

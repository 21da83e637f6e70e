"""The device mesh for data x tensor x pipeline parallel runs."""

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def build_mesh(dp=1, tp=1, pp=1, device_type="cpu"):
    """A DeviceMesh of shape (pp, dp, tp) named ("pp", "dp", "tp") over the whole world.

    tp is innermost so that a tensor-parallel group is consecutive ranks (one node); dp is next,
    pp outermost (Megatron-LM's order). The process group must already be initialised.
    """
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
    world = dist.get_world_size()
    if dp * tp * pp != world:
        raise ValueError(f"parallel.dp={dp} x parallel.tp={tp} x parallel.pp={pp} = {dp * tp * pp}"
                         f" ranks, but the world size is {world}")
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))


def mesh_size(mesh, name):
    """Size of the named mesh dimension, 1 when the mesh has no such dimension."""
    if mesh is None or mesh.mesh_dim_names is None or name not in mesh.mesh_dim_names:
        return 1
    return mesh[name].size()

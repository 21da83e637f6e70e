"""ParallelLayout: the data x tensor x pipeline sizes of a run, every rank's coordinates, the
DeviceMesh, and every rule a layout must keep (with the message naming the setting).

    layout = ParallelLayout.resolve(world_size=8, tp=2, pp=2)      # dp = 8 / (2 * 2) = 2
    layout.check_model(model.config)                               # heads, kv heads, ffn, layers
    n_mb = layout.micro_batches(global_batch=16, micro_batch=2)    # pipeline micro-batches
    mesh = layout.build_mesh("cpu")                                # ("pp", "dp", "tp")
    pp_rank, dp_rank, tp_rank = layout.coords(rank)

The training runtime (`fastllm train`), fastllm.parallel and the planner (which checks each
candidate layout with the same rules) all use it. As torchtitan's ParallelDims
(torchtitan/distributed/parallel_dims.py), tp is innermost (a tensor-parallel group is
consecutive ranks, one node), dp next and pp outermost (Megatron-LM's order).
"""

import dataclasses

__all__ = ["ParallelLayout", "SCHEDULES", "bubble_fraction", "build_mesh", "check_micro_batches",
           "mesh_size"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def bubble_fraction(pp, micro_batches, chunks=1):
    """The pipeline's idle share of a step: (p - 1) / (v m + p - 1) for v model chunks per rank
    and m micro-batches (Narayanan et al., SC 2021, sections 2.2.1-2.2.2)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (chunks * micro_batches + pp - 1)


def check_micro_batches(schedule, pp, n_microbatches, source=""):
    """The pipeline schedule's rules on its micro-batch count: 1F1B and interleaved need at
    least pp (each stage must reach its first backward), interleaved a multiple of pp. source:
    how n_microbatches was derived, for the message."""
    if not _is_int(n_microbatches) or n_microbatches < 1:
        raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}"
                         + (f" ({source})" if source else ""))
    got = f"{source} = {n_microbatches}" if source else f"n_microbatches={n_microbatches}"
    if schedule != "gpipe" and n_microbatches < pp:
        raise ValueError(f"parallel.schedule={schedule} needs at least parallel.pp={pp} "
                         f"micro-batches per step, got {got}; raise global_batch_size or lower "
                         f"micro_batch_size")
    if schedule == "interleaved" and n_microbatches % pp:
        raise ValueError(f"parallel.schedule=interleaved needs the micro-batches per step "
                         f"({got}) to be a multiple of parallel.pp={pp}")


def _is_int(value):
    # bool is an int to Python, but dp=True is a slip, not a size
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """dp x tp x pp ranks. schedule: the pipeline's (gpipe | 1f1b | interleaved); chunks: model
    chunks per pipeline rank (default 2 for interleaved, else 1); sequence_parallel: tensor
    parallel with the norms and residual stream sharded on the sequence."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    chunks: int = 0
    sequence_parallel: bool = False

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule must be one of {SCHEDULES}, got "
                             f"{self.schedule!r}")
        if _is_int(self.chunks) and self.chunks == 0:  # (the default: 0 is "by the schedule")
            object.__setattr__(self, "chunks", 2 if self.schedule == "interleaved" else 1)
        for name in ("dp", "tp", "pp", "chunks"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        # only the interleaved schedule runs several model chunks a rank; with another one,
        # stages (pp x chunks) would count stages that are never built
        if self.chunks != 1 and self.schedule != "interleaved":
            raise ValueError(f"parallel.chunks={self.chunks} needs parallel.schedule=interleaved,"
                             f" got parallel.schedule={self.schedule}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tp > 1")

    @classmethod
    def resolve(cls, world_size, dp=0, tp=1, pp=1, **kw):
        """The layout of world_size ranks: dp <= 0 means world_size / (tp * pp)."""
        # checked before dp is derived from them, so the message names the setting at fault
        for name, value in (("tp", tp), ("pp", pp)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"parallel.{name} must be a positive integer, got {value!r}")
        if not _is_int(dp):
            raise ValueError(f"parallel.dp must be an integer (<= 0: world size / (tp * pp)), "
                             f"got {dp!r}")
        inner = tp * pp
        if world_size % inner:
            raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} = {inner} does not divide the "
                             f"world size {world_size}")
        if dp > 0 and dp * inner != world_size:
            raise ValueError(f"parallel.dp={dp} x parallel.tp={tp} x parallel.pp={pp} = "
                             f"{dp * inner} ranks, but the world size is {world_size}")
        return cls(dp=world_size // inner, tp=tp, pp=pp, **kw)

    @classmethod
    def from_config(cls, parallel, world_size):
        """From a fastllm.train ParallelConfig (parallel.dp/tp/pp/schedule/sequence_parallel)."""
        return cls.resolve(world_size, parallel.dp, parallel.tp, parallel.pp,
                           schedule=parallel.schedule,
                           sequence_parallel=parallel.sequence_parallel)

    @property
    def world_size(self):
        return self.dp * self.tp * self.pp

    @property
    def stages(self):
        """Pipeline stages in all (chunks per rank x pp)."""
        return self.pp * self.chunks

    def coords(self, rank):
        """(pp_rank, dp_rank, tp_rank) of a global rank: the mesh's row-major order."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def describe(self):
        return f"dp {self.dp} x tp {self.tp} x pp {self.pp}"

    # ----- the rules -----

    def check_model(self, config, vocab_parallel=False, even_stages=False):
        """Raise ValueError naming the setting when this layout cannot split the model.

        config: a transformers config, or anything with num_attention_heads,
        num_key_value_heads, intermediate_size (may be None), num_hidden_layers, vocab_size.
        vocab_parallel: the embedding and head are split on the vocabulary (tp must divide
        it, embeddings untied). even_stages: every pipeline stage holds as many layers (the
        planner's cost model); otherwise at least one layer a stage.
        """
        tp, heads = self.tp, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        ffn = getattr(config, "intermediate_size", None)
        if heads % tp:
            raise ValueError(f"parallel.tp={tp} does not divide num_attention_heads={heads}")
        if kv % tp:
            raise ValueError(f"parallel.tp={tp} does not divide num_key_value_heads={kv}")
        if ffn is not None and ffn % tp:
            raise ValueError(f"parallel.tp={tp} does not divide intermediate_size={ffn}")
        if vocab_parallel:
            if config.vocab_size % tp:
                raise ValueError(f"parallel.tp={tp} does not divide "
                                 f"vocab_size={config.vocab_size}")
            if getattr(config, "tie_word_embeddings", False):
                raise ValueError("tensor parallel needs untied embeddings (tie_word_embeddings="
                                 "False): the embedding is row-split and the head column-split "
                                 "on the vocabulary")
        layers = config.num_hidden_layers
        if even_stages and layers % self.stages:
            raise ValueError(f"parallel.pp={self.pp} x chunks={self.chunks} does not divide "
                             f"num_hidden_layers={layers}")
        if layers < self.stages:
            raise ValueError(f"parallel.pp={self.pp}"
                             + (f" with parallel.schedule=interleaved ({self.chunks} stages per "
                                f"rank)" if self.chunks > 1 else "")
                             + f" needs at least {self.stages} decoder layers; the model has "
                               f"num_hidden_layers={layers}")

    def vocab_parallel(self, config):
        """Whether the embedding and head can be split on the vocabulary over tp."""
        return (config.vocab_size % self.tp == 0
                and not getattr(config, "tie_word_embeddings", False))

    def default_global_batch(self, micro_batch):
        """One micro-batch per data-parallel rank, times pp micro-batches under pipeline
        parallel (the fewest that fill a 1F1B pipeline)."""
        return micro_batch * self.dp * self.pp

    def micro_batches(self, global_batch, micro_batch):
        """Micro-batches per data-parallel rank and step (the pipeline's micro-batches, or the
        accumulation steps), checked against the batch and the schedule."""
        # before the division: 0 divides nothing, and a batch of 0 or fewer rows is no step
        for name, value in (("global_batch_size", global_batch),
                            ("micro_batch_size", micro_batch)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        per_replica = micro_batch * self.dp
        if global_batch % per_replica:
            raise ValueError(f"global_batch_size={global_batch} must be a multiple of "
                             f"micro_batch_size * data-parallel size = {micro_batch} * {self.dp} "
                             f"(parallel.dp={self.dp})")
        n = global_batch // per_replica
        if self.pp > 1:
            check_micro_batches(self.schedule, self.pp, n, f"global_batch_size / "
                                f"(micro_batch_size * dp) = {global_batch} / ({micro_batch} * "
                                f"{self.dp})")
        return n

    # ----- the mesh -----

    def build_mesh(self, device_type="cpu"):
        """A DeviceMesh of shape (pp, dp, tp) named ("pp", "dp", "tp") over the whole world
        (the process group must already be initialised)."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if self.world_size != world:
            raise ValueError(f"parallel.dp={self.dp} x parallel.tp={self.tp} x parallel.pp="
                             f"{self.pp} = {self.world_size} ranks, but the world size is "
                             f"{world}")
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp),
                                mesh_dim_names=("pp", "dp", "tp"))


def build_mesh(dp=1, tp=1, pp=1, device_type="cpu"):
    """ParallelLayout(dp, tp, pp).build_mesh(device_type)."""
    return ParallelLayout(dp=dp, tp=tp, pp=pp).build_mesh(device_type)


def mesh_size(mesh, name):
    """Size of the named mesh dimension, 1 when the mesh has no such dimension."""
    if mesh is None or mesh.mesh_dim_names is None or name not in mesh.mesh_dim_names:
        return 1
    return mesh[name].size()

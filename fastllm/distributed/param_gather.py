"""DistributedOptimizer's param all-gather after step(): started per bucket, and waited for at once
or (overlap_param_gather) by the forwards that read the params. A base class of
fastllm.distributed.DistributedOptimizer.

Which forward waits for which bucket, with overlap_param_gather:
    - a module's forward pre-hook waits for the buckets of its own params
      (module.parameters(recurse=False)), so the gathers of later layers overlap the forward of
      earlier ones;
    - the root module's (the `model` given to DistributedOptimizer) forward pre-hook first waits
      for the buckets of every module whose forward has not been seen to run yet: a param read by
      another module's forward while its own module is never called (F.linear(h,
      self.head.weight), nn.MultiheadAttention's out_proj) is current too. A module counts as
      seen once its forward ran, in any forward, the ones before the first step() included.
Still stale: a param read before its own module has run in the same forward, by a module that
was seen to run before, or through a forward that does not start at the root (a submodule
called directly). Call finish_param_sync() before such reads, or leave overlap_param_gather off.
Writes too: model.state_dict() and model.load_state_dict() wait for the gathers themselves, but a
param written directly while its gather is in flight (p.data.copy_, swapping EMA weights in) is
overwritten by the gather: call finish_param_sync() first.
"""

from fastllm.distributed import failure
from fastllm.distributed.optimizer_state import _all_gather


class DistributedParamGather:
    def _register_gather_waits(self, model):
        self._forward_hooks = []
        if not self.overlap_param_gather:
            return
        # id(module) -> its buckets, for the modules whose forward has not run yet.
        self._unseen = {}
        for module in model.modules():
            own = {self._where[id(p)][0].index for p in module.parameters(recurse=False)
                   if id(p) in self._where}
            if own:
                buckets = [self.buckets[i] for i in sorted(own)]
                self._unseen[id(module)] = buckets
                self._forward_hooks.append(module.register_forward_pre_hook(
                    self._make_gather_waiter(id(module), buckets)))
        self._forward_hooks.append(model.register_forward_pre_hook(self._wait_unseen,
                                                                   prepend=True))

    def _wait_unseen(self, module, args):
        if self._gathers_pending:
            for buckets in self._unseen.values():
                for b in buckets:
                    self._wait_gather(b)

    def _make_gather_waiter(self, key, buckets):
        def wait_for_params(module, args):
            self._unseen.pop(key, None)
            if self._gathers_pending:
                for b in buckets:
                    self._wait_gather(b)
        return wait_for_params

    def _start_param_gather(self):
        for b in self.buckets:
            if b.replicated:  # updated whole on every rank
                continue
            shard = b.param_flat[b.lo:b.hi].clone()
            b.gather_work = _all_gather(b.param_flat, shard, group=self.group, async_op=True)
        self._gathers_pending = True

    def _wait_gather(self, b):
        if b.gather_work is not None:
            failure.wait(b.gather_work, f"parameter all-gather of bucket {b.index}", self.timeout)
            b.gather_work = None

    def finish_param_sync(self):
        """Wait for the params' all-gather after step() (forward, model.state_dict() and
        model.load_state_dict() do this themselves; call it before reading or writing params any
        other way)."""
        self._finish_param_gather()

    def _finish_param_gather(self):
        if self._gathers_pending:
            for b in self.buckets:
                self._wait_gather(b)
            self._gathers_pending = False

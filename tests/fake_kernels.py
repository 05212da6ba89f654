"""A fake launchable kernel and a workspace-allocation recorder, for the composed gemms' launch and
plan plumbing on the CPU (SplitKGemm, PaddedGemm in tile_ops.kernels.gemm_launch)."""

import copy

import torch


class FakeKernel:
    """Records its launches as (name, pointers, device) in ``log``; its plan is one step (name, buffers)."""

    def __init__(self, params, log, name, needs_workspace=False, dims=()):
        self.meta = type("Meta", (), {"params": params, "needs_workspace": needs_workspace, "dims": list(dims)})()
        self.log, self.name = log, name
        self.programmatic = False

    def dependent(self):
        """A copy launched programmatically (``Kernel.dependent``), logging under the same name."""
        if self.programmatic:
            return self
        twin = copy.copy(self)
        twin.programmatic = True
        return twin

    def launch_ptrs(self, ptrs, device, dims=()):
        self.log.append((self.name, list(ptrs), device))

    def plan(self, device, buffers, scratch=None, dims=()):
        return [], [(self.name, list(buffers))]


def record_allocations(monkeypatch, module) -> list:
    """(shape, dtype, data pointer) of every ``torch.empty`` that ``module`` makes from now on."""
    allocs, real_empty = [], torch.empty

    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        allocs.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    monkeypatch.setattr(module.torch, "empty", empty)
    return allocs

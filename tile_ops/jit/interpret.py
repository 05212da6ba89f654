"""Run a tile program on CPU tensors: the code the compiler lowers for the GPU, executed thread by thread by the
emulator (``emulator.py``), so a kernel can be written and debugged without a GPU.

    import tile_ops
    prog = my_kernel.fn(128, 128, 64)                     # a @tile_ops.jit factory's program, or a T.prim_func
    c = torch.empty(128, 128, dtype=torch.float16)
    tile_ops.interpret(prog, a, b, c)                      # every parameter, outputs too; T.Scalars by name

or, with ``TILE_OPS_INTERPRET=1`` in the environment, the factories themselves: ``my_kernel(128, 128, 64)``
returns an :class:`Interpreted` kernel instead of compiling one, called as a compiled one is (``kernel(a, b)``
allocates the outputs, NaN-filled, on the CPU; ``kernel.launch(a, b, c)`` writes in place).

The tensors are written in place, as a launch writes CUDA tensors; the result is the count of PTX-level
instructions that ran (``mma.f16``, ``tma.load.2d.swizzle128``, ``wgmma.m64n64k16.f16``, ...).  Shared memory
starts as NaN, so a read of shared memory nothing wrote shows; an index past a tensor's end raises.  Slow
(numpy, Python generators per thread): sizes of a few tiles."""

from __future__ import annotations

import os

ENV = "TILE_OPS_INTERPRET"


def enabled() -> bool:
    """Whether ``TILE_OPS_INTERPRET`` asks the ``@tile_ops.jit`` factories for interpreted kernels."""
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


class Interpreted:
    """A program lowered for ``arch``, run by the emulator on CPU tensors with a compiled ``Kernel``'s calls:
    ``kernel(*inputs, **scalars)`` allocates the outputs ``out_idx`` names (NaN-filled: what no thread writes
    shows) and returns them, ``kernel.launch(*tensors, **scalars)`` writes every parameter in place.  ``ran``:
    the instructions the last run executed."""

    def __init__(self, program, arch: str = "sm_90a", out_idx=()):
        from ..compiler.lower import lower

        self.lowered = lower(program, arch)
        self.meta = self.lowered.meta.replace(out_idx=list(out_idx))
        self.ran: dict = {}

    def launch(self, *tensors, ctas: int | None = None, **scalars) -> None:
        self.ran = _run(self.lowered, tensors, ctas, scalars)

    def __call__(self, *inputs, **scalars):
        from .kernel import LaunchDims, call_with_outputs

        m = self.meta
        dims = LaunchDims(m, [i for i in range(len(m.params)) if i not in m.out_idx])
        return call_with_outputs(m, dims, inputs, "cpu", lambda *args: self.launch(*args, **scalars), poison=True)


def interpret(program, *tensors, arch: str = "sm_90a", ctas: int | None = None, **scalars):
    """Lower ``program`` for ``arch`` and run it over ``tensors`` (CPU torch tensors, one per parameter, in
    order, with the shapes, dtypes and strides the program declares); returns the instructions that ran.
    ``ctas``: a persistent kernel's CTA count (default: the launch's, up to the SM count; fewer run faster
    here, and stream-K splits its work by it).  A workspace (stream-K's partials and flags) is allocated zeroed,
    and its flags must be zero again at the end, as the next launch sharing it needs."""
    kernel = Interpreted(program, arch)
    kernel.launch(*tensors, ctas=ctas, **scalars)
    return kernel.ran


def _run(lk, tensors, ctas, scalars) -> dict:
    """The lowered kernel ``lk`` over ``tensors``: ``interpret``'s run."""
    import numpy as np
    import torch

    from ..compiler.meta import FLAG_SLOTS, WORKSPACE, evaluate
    from .emulator import Emulator
    from .kernel import EntryArgs, LaunchDims, check_layouts, workspace_bytes

    m = lk.meta
    if len(tensors) != len(m.params):
        names = ", ".join(name for name, _, _ in m.params)
        raise TypeError(f"interpret: {m.name} takes {len(m.params)} tensors, one per parameter ({names}), "
                        f"got {len(tensors)}")
    for (name, _, _), t in zip(m.params, tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            what = f"a tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"interpret: parameter {name} must be a CPU torch.Tensor, got {what}")
    launch_dims = LaunchDims(m, list(range(len(m.params))))
    dims = launch_dims.read(tensors)
    named = launch_dims.named(dims)
    check_layouts(m, tensors, named, "interpret")
    missing = [name for name, _ in m.scalars if name not in scalars]
    if missing:
        raise TypeError(f"interpret: {m.name} needs the T.Scalars {', '.join(missing)} by name")
    arrays = {name: _memory(t, flat=name in m.strides) for (name, _, _), t in zip(m.params, tensors)}
    entry = EntryArgs(m)
    maps = {name: entry.spec(name, dims) for name in m.tensormaps}
    grid = tuple(evaluate(g, named) for g in m.grid)
    if ctas is not None:
        if not m.persistent_tiles:
            raise ValueError(f"interpret: ctas={ctas} sets a persistent kernel's CTA count; {m.name} launches a "
                             f"grid of {grid}")
        grid = (ctas, 1, 1)
    workspace = None
    if any(p.name == WORKSPACE for p in lk.func.params):
        workspace = np.zeros(workspace_bytes(m, launch_dims, grid, dims) // 4, np.float32)
        arrays[WORKSPACE] = workspace
    emulator = Emulator(lk.func, {**arrays, **named, **scalars}, tensormaps=maps)
    if 0 not in grid:
        emulator.run(grid, m.cluster_dims, resident=bool(m.persistent_tiles))  # a persistent grid is all resident
    if workspace is not None and workspace[:FLAG_SLOTS].view(np.int32).any():
        raise RuntimeError(f"interpret: {m.name} left workspace flags set (at "
                           f"{np.flatnonzero(workspace[:FLAG_SLOTS].view(np.int32))[:8].tolist()}): the next launch "
                           f"sharing the workspace would read them")
    return emulator.ran


def _memory(t, flat: bool):
    """The numpy array the emulator indexes for ``t``, sharing its memory (so the emulator's stores land in the
    tensor; bfloat16 as its bits): a row-major tensor as it is, a strided one (``flat``: the program indexes it
    through its strides) as its storage from its first element."""
    import numpy as np
    import torch

    if flat:
        t = t.as_strided((t.untyped_storage().nbytes() // t.element_size() - t.storage_offset(),), (1,),
                         t.storage_offset())
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()

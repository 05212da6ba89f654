"""Run a tile program on CPU tensors: the code the compiler lowers for the GPU, executed thread by thread by the
emulator (``emulator.py``), so a kernel can be written and debugged without a GPU.

    import tile_ops
    prog = my_kernel.fn(1024, 1024, 1024)                 # a @tile_ops.jit factory's program, or a T.prim_func
    c = torch.empty(1024, 1024, dtype=torch.float16)
    tile_ops.interpret(prog, a, b, c)                      # every parameter, outputs too; T.Scalars by name

The tensors are written in place, as a launch writes CUDA tensors; the result is the count of PTX-level
instructions that ran (``mma.sync.m16n8k16``, ``tma.load.2d.swizzle128``, ...).  Shared memory starts as NaN,
so a read of shared memory nothing wrote shows; an index past a tensor's end raises.  Slow (numpy, Python
generators per thread): sizes of a few tiles."""

from __future__ import annotations


def interpret(program, *tensors, arch: str = "sm_90a", **scalars):
    """Lower ``program`` for ``arch`` and run it over ``tensors`` (CPU torch tensors, one per parameter, in
    order, with the shapes, dtypes and strides the program declares); returns the instructions that ran."""
    import torch

    from ..compiler.lower import lower
    from ..compiler.meta import evaluate
    from .emulator import Emulator
    from .kernel import LaunchDims, check_layouts

    lk = lower(program, arch)
    m = lk.meta
    if len(tensors) != len(m.params):
        names = ", ".join(name for name, _, _ in m.params)
        raise TypeError(f"interpret: {m.name} takes {len(m.params)} tensors, one per parameter ({names}), "
                        f"got {len(tensors)}")
    for (name, _, _), t in zip(m.params, tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            what = f"a tensor on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"interpret: parameter {name} must be a CPU torch.Tensor, got {what}")
    if m.needs_workspace:
        raise NotImplementedError(f"interpret: {m.name} keeps partials in a workspace (stream-K, "
                                  f"T.row_reduce_store); the interpreter does not allocate one")
    dims = LaunchDims(m, list(range(len(m.params))))
    named = dims.named(dims.read(tensors))
    check_layouts(m, tensors, named, "interpret")
    missing = [name for name, _ in m.scalars if name not in scalars]
    if missing:
        raise TypeError(f"interpret: {m.name} needs the T.Scalars {', '.join(missing)} by name")
    arrays = {name: _memory(t, flat=name in m.strides) for (name, _, _), t in zip(m.params, tensors)}
    maps = {n: dict(spec, dims=[evaluate(d, named) for d in spec["dims"]],
                    strides=[evaluate(s, named) for s in spec["strides"]]) for n, spec in m.tensormaps.items()}
    emulator = Emulator(lk.func, {**arrays, **named, **scalars}, tensormaps=maps)
    grid = tuple(evaluate(g, named) for g in m.grid)
    if 0 not in grid:
        emulator.run(grid, m.cluster_dims, resident=bool(m.persistent_tiles))  # a persistent grid is all resident
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

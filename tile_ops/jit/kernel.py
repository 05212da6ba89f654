"""A compiled kernel: CUDA source, cubin, launch geometry and a call that launches it on the
current torch stream.  Nothing here imports TVM."""

from __future__ import annotations

import math

from ..compiler import check_grid
from ..compiler.meta import FLAG_SLOTS, WORKSPACE, KernelMeta, PlanExpr, evaluate, span

_TORCH_DTYPES = {
    "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
    "int32": "int32", "int8": "int8", "uint8": "uint8",
}


DIM = "dim"  # EntryArgs.sources: an argument that takes a T.dynamic size's value
PLAN_VALUE = -1  # a plan step's argument (PLAN_VALUE, int): a 32-bit value, not a buffer's pointer (plans.cpp)

TENSORMAP_KEYS = ("tensor", "dtype", "dims", "strides", "box", "element_strides", "swizzle", "l2_promotion",
                  "oob_fill")


class EntryArgs:
    """The CUDA entry's arguments, in ``meta.kept`` order, from one data pointer per program parameter.

    A kept name with a ``meta.tensormaps`` spec takes the TMA descriptor (128 bytes, passed by value)
    of the pointer of the spec's ``"tensor"``; ``WORKSPACE`` takes the workspace's pointer (``build``'s
    ``workspace``); any other kept name is a program parameter and takes its pointer.  ``encode`` is the
    launcher's ``encode_tensor_map`` unless a test passes another.
    """

    _MAX_DESCRIPTORS = 64  # the caching allocator hands out many pointers in a long run: stay tiny

    def __init__(self, meta: KernelMeta, encode=None):
        self._tensormaps = meta.tensormaps
        self._encode = encode
        self._descriptors: dict = {}  # (kept name, pointer, dims) -> bytes: launches mostly reuse buffers
        position = {name: i for i, (name, _, _) in enumerate(meta.params)}
        self._dim_names = [name for name, _ in meta.dims]
        values = self._dim_names + [name for name, _ in meta.scalars]
        # per kept name: (position of the tensor whose pointer it takes, tensormap name or None); a T.dynamic
        # size or a T.Scalar takes its value: (DIM, its index in the values, meta.dims then meta.scalars)
        self.sources = []
        for name in meta.kept:
            if name == WORKSPACE:
                self.sources.append((-1, None))
                continue
            if name in values:
                self.sources.append((DIM, values.index(name)))
                continue
            spec = meta.tensormaps.get(name)
            if spec is not None:
                missing = [k for k in TENSORMAP_KEYS if k not in spec]
                if missing:
                    raise ValueError(f"{meta.name}: tensormap {name} lacks {', '.join(missing)}")
            tensor = name if spec is None else spec["tensor"]
            if tensor not in position:
                raise ValueError(f"{meta.name}: the CUDA entry parameter {name} needs the pointer of {tensor}, "
                                 f"which is not a parameter ({', '.join(position)})")
            self.sources.append((position[tensor], None if spec is None else name))
        self._pointer_positions = [pos for pos, _ in self.sources]
        self._plain = not self._tensormaps and not meta.dims and not meta.scalars
        self._needs_workspace = WORKSPACE in meta.kept

    def build(self, ptrs, device: int, workspace: int = 0, dims: tuple = ()) -> list:
        """The entry's arguments from one pointer per parameter, the workspace's pointer and the values of the
        kernel's T.dynamic sizes (in ``meta.dims`` order) then of its T.Scalars (``Kernel.values``: 32-bit
        patterns, passed as the low 4 bytes of a 64-bit argument)."""
        if self._needs_workspace:
            if not workspace:
                raise ValueError("a stream-K kernel's arguments need its workspace (Kernel.launcher passes it)")
            ptrs = list(ptrs) + [workspace]  # position -1
        if self._plain:
            return [ptrs[pos] for pos in self._pointer_positions]
        return [dims[tmap] & 0xFFFFFFFF if pos is DIM else ptrs[pos] if tmap is None else
                self._descriptor(tmap, ptrs[pos], device, dims) for pos, tmap in self.sources]

    def spec(self, tmap: str, dims: tuple = ()) -> dict:
        """Tensor map ``tmap``'s spec with its dims and strides evaluated for the T.dynamic sizes ``dims``."""
        s = self._tensormaps[tmap]
        if not dims:
            return s
        named = dict(zip(self._dim_names, dims))
        return dict(s, dims=[evaluate(d, named) for d in s["dims"]], strides=[evaluate(d, named) for d in s["strides"]])

    def _descriptor(self, tmap: str, ptr: int, device: int, dims: tuple = ()) -> bytes:
        desc = self._descriptors.get((tmap, ptr, dims))
        if desc is None:
            if len(self._descriptors) >= self._MAX_DESCRIPTORS:
                self._descriptors.clear()
            if self._encode is None:
                from .launcher import get_launcher

                self._encode = get_launcher().encode_tensor_map
            s = self.spec(tmap, dims)
            desc = self._encode(s["dtype"], ptr, s["dims"], s["strides"], s["box"], s["element_strides"],
                                s["swizzle"], l2_promotion=s["l2_promotion"], oob_fill=s["oob_fill"], device=device)
            self._descriptors[(tmap, ptr, dims)] = desc
        return desc


def encode_scalar(name: str, value, dtype: str) -> int:
    """A T.Scalar's value as the signed 32-bit pattern a launch passes (plans.cpp's value arguments)."""
    import struct

    if dtype == "float32":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"T.Scalar {name} (float32): got {type(value).__name__}; accepted: a float")
        return struct.unpack("<i", struct.pack("<f", float(value)))[0]
    if isinstance(value, bool) or not isinstance(value, int) or not -2**31 <= value < 2**31:
        raise TypeError(f"T.Scalar {name} (int32): got {value!r}; accepted: an int in [-2^31, 2^31)")
    return value


def _device_index(device) -> int:
    """``device``'s index (a torch.device without one means the current CUDA device)."""
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def _sm_count(index: int) -> int | None:
    try:
        import torch

        return torch.cuda.get_device_properties(index).multi_processor_count
    except Exception:  # noqa: BLE001 - no CUDA torch (CPU tests on a fake driver)
        return None


_workspaces: dict = {}  # (device index, stream) -> zeroed tensor: stream-K workspaces, kept (see workspace())


def workspace(index: int, stream: int, nbytes: int):
    """A stream-K workspace (a tensor) of at least ``nbytes`` on device ``index`` for launches on ``stream``
    (the current one): zeroed once and kept, since the kernels leave its flags zero (stream_k.py).  One
    per stream, so launches that may overlap never share one.  While the stream is being captured into a
    CUDA graph, always a new one, freed after the launch like any temporary (its zeroing is captured too):
    a graph never holds the address of a kept one, which a bigger one may replace."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    ws = _workspaces.get((index, stream))
    if ws is None or ws.numel() < nbytes:
        ws = _workspaces[(index, stream)] = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    return ws


def _current_stream_getter():
    """``stream(device_index)`` -> the current torch stream's raw handle.  torch's CUDA builds have a
    C getter; building a ``torch.cuda.Stream`` object per call costs microseconds."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def call_with_outputs(meta: KernelMeta, dims: "LaunchDims", inputs, device, launch, poison: bool = False):
    """A kernel's ``kernel(*inputs)``: ``inputs`` at the parameters ``out_idx`` does not name, the outputs
    allocated on ``device`` at the sizes ``dims`` reads from them (``poison``: NaN-filled, 0 for integers, so what
    no thread writes shows), ``launch(*every parameter)``; returns the outputs."""
    import torch

    in_pos = [i for i in range(len(meta.params)) if i not in meta.out_idx]
    if len(inputs) != len(in_pos):
        names = [meta.params[i][0] for i in in_pos]
        raise TypeError(f"{meta.name} takes {len(names)} tensors ({', '.join(names)}), got {len(inputs)}")
    args = [None] * len(meta.params)
    for pos, t in zip(in_pos, inputs):
        args[pos] = t
    named = dims.named(dims.read(args)) if meta.dims else {}
    for pos in meta.out_idx:
        name, shape, dtype = meta.params[pos]
        torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
        shape = [evaluate(d, named) for d in shape]
        strides = [evaluate(st, named) for st in meta.strides.get(name, ())] or None
        out = (torch.empty(shape, dtype=torch_dtype, device=device) if strides is None
               else torch.empty_strided(shape, strides, dtype=torch_dtype, device=device))
        args[pos] = out.fill_(float("nan") if torch_dtype.is_floating_point else 0) if poison else out
    launch(*args)
    outs = [args[i] for i in meta.out_idx]
    return outs[0] if len(outs) == 1 else tuple(outs)


class Kernel:
    """``kernel(*inputs)`` allocates the outputs named by ``out_idx``, launches, and returns them."""

    def __init__(self, meta: KernelMeta, source: str, cubin: bytes, programmatic: bool = False):
        self.meta, self.source, self.cubin = meta, source, cubin
        self.programmatic = programmatic  # launched with programmatic stream serialization (``dependent``)
        self._dependent = None
        self._function = None
        self._bound: dict = {}  # torch.device -> launch(ptrs), see launcher
        self._grids: dict = {}  # device index -> launch grid (grid_on)
        self._entry_args = EntryArgs(meta)
        self.dims = LaunchDims(meta, [i for i in range(len(meta.params)) if i not in meta.out_idx])

    def __repr__(self) -> str:
        m = self.meta
        return f"<tile_ops.Kernel {m.name} {m.arch} grid={m.grid} block={m.block} smem={m.smem_bytes}B>"

    def sass(self) -> str:
        from .build import sass

        return sass(self.cubin)

    def instruction_mix(self) -> dict:
        from .build import instruction_mix

        return instruction_mix(self.sass())

    def _fn(self):
        if self._function is None:
            from .launcher import CudaFunction

            self._function = CudaFunction(self.cubin, self.meta.entry, self.meta.smem_bytes, self.programmatic)
        return self._function

    def dependent(self) -> "Kernel":
        """This kernel as a later step of a composed gemm (split-K's reduction, the gemm after its pads):
        launched with programmatic stream serialization, so it launches while the step before it runs and
        waits for it at its entry (its launch latency hidden).  Only there: back-to-back single kernels
        measured up to 5 % slower that way.  Itself where the code has no such wait."""
        if not self.meta.waits_at_entry or self.programmatic:
            return self
        if self._dependent is None:
            self._dependent = Kernel(self.meta, self.source, self.cubin, programmatic=True)
        return self._dependent

    def __call__(self, *inputs, **scalars):
        import torch

        if not inputs:
            device = torch.device("cuda", torch.cuda.current_device())
        else:  # a non-tensor has no device: launch refuses it by name
            device = inputs[0].device if isinstance(inputs[0], torch.Tensor) else None
        return call_with_outputs(self.meta, self.dims, inputs, device, lambda *args: self.launch(*args, **scalars))

    def values(self, dims: tuple = (), **scalars) -> tuple:
        """The launch's values: the T.dynamic sizes ``dims`` (``self.dims.read``), then the T.Scalars by name."""
        names = [name for name, _ in self.meta.scalars]
        if set(scalars) != set(names):
            raise TypeError(f"{self.meta.name} takes the scalars {', '.join(names) or 'none'}; got "
                            f"{', '.join(sorted(scalars)) or 'none'}")
        return tuple(dims) + tuple(encode_scalar(n, scalars[n], dt) for n, dt in self.meta.scalars)

    def grid_on(self, index: int, dims: tuple = ()) -> tuple:
        """The launch grid on device ``index`` for the T.dynamic sizes ``dims`` (in ``meta.dims`` order):
        ``meta.grid``, except for a persistent kernel, whose CTAs stride over its tiles by gridDim.x: as
        many as the device holds at once (SMs x CTAs per SM, or, clustered, the clusters that fit, which
        depends on how the GPCs split the SMs), at most one per tile.  Without CUDA (fake drivers in tests)
        or an occupancy answer, ``meta.grid``.  A grid past CUDA's limits is a ValueError."""
        grid = self._grids.get((index, dims))
        if grid is None:
            if len(self._grids) >= 256:  # one per device and size seen: stay small
                self._grids.clear()
            grid = self._grids[(index, dims)] = self._grid(index, self.dims.named(dims))
        return grid

    def _grid(self, index: int, named: dict) -> tuple:
        m = self.meta
        grid = self.grid_of(index, named)
        if m.persistent_tiles:
            assert grid[0] % m.cluster == 0, (grid, m.cluster)  # whole clusters walk the same tiles in lockstep
        if m.dims:
            self.dims.check(tuple(named.values()))
            check_grid(m.name, grid, m.arch)
        return grid

    def grid_of(self, index: int, named: dict) -> tuple:
        """The launch grid for the T.dynamic sizes ``named`` (ints, or PlanExprs: then a plan family's grid)."""
        m = self.meta
        if not m.persistent_tiles:
            return tuple(evaluate(g, named) for g in m.grid)
        resident = None
        if m.cluster > 1:
            clusters = self._fn().max_active_clusters(index, m.cluster, m.block[0])
            resident = clusters * m.cluster if clusters > 0 else None
        else:
            sms = _sm_count(index)
            resident = sms * m.ctas_per_sm if sms else None
        tiles = evaluate(m.persistent_tiles, named)
        return (evaluate(m.grid[0], named) if resident is None else PlanExpr.apply("min", resident, tiles), 1, 1)

    def launch_ptrs(self, ptrs, device, dims: tuple = ()):
        """Fast path for callers that validated their tensors: one pointer per parameter, in order, and the
        values of the kernel's T.dynamic sizes (``dims``, in ``meta.dims`` order; ``self.dims.read``)."""
        self.launcher(device)(ptrs, dims)

    def launcher(self, device):
        """``launch(ptrs, dims=())`` on ``device`` (a torch.device), with everything fixed per device bound
        once: the loaded function, the geometry (per ``dims``) and the stream getter.  A call reads the current
        stream, builds the argument list and enters the extension's launch: the ops' per-call path."""
        bound = self._bound.get(device)
        if bound is None:
            if device.index is None and device.type == "cuda":  # the current device, which may change
                import torch

                return self.launcher(torch.device(device.type, _device_index(device)))
            bound = self._bound[device] = self._bind(device)
        return bound

    def _bind(self, device):
        index = _device_index(device)
        fn, m = self._fn(), self.meta
        launch, handle = fn.bind(index)
        build, stream = self._entry_args.build, _current_stream_getter()
        block, smem, name = m.block, fn.smem_bytes, fn.name
        if m.dims or m.scalars:
            def bound(ptrs, dims=()):
                grid = self.grid_on(index, dims)
                if 0 in grid:  # a size of 0: nothing to compute
                    return
                s = stream(index)
                ws = workspace(index, s, self.workspace_bytes(grid, dims)) if m.needs_workspace else None
                launch(handle, grid, block, smem, s, build(ptrs, index, 0 if ws is None else ws.data_ptr(), dims), name)

            return bound
        grid = self.grid_on(index)
        if m.needs_workspace:
            nbytes = self.workspace_bytes(grid)

            def bound(ptrs, dims=()):
                s = stream(index)
                ws = workspace(index, s, nbytes)
                launch(handle, grid, block, smem, s, build(ptrs, index, ws.data_ptr()), name)

            return bound

        def bound(ptrs, dims=()):
            launch(handle, grid, block, smem, stream(index), build(ptrs, index), name)

        return bound

    def workspace_bytes(self, grid, dims: tuple = ()) -> int:
        return workspace_bytes(self.meta, self.dims, grid, dims)

    def plan(self, device, buffers, scratch=None, dims: tuple = ()):
        """This kernel's launch as a plan program for the ops' fast path (csrc/plans.cpp):
        ``(scratch buffers, steps)`` = ``([], [(function, grid, block, smem, name, args)])``, where
        ``buffers[i]`` is the plan buffer holding program parameter i and each entry argument is
        ``(buffer, tensor map spec or None)``.  ``scratch`` (the first free buffer) is unused: a
        single kernel needs none.  A stream-K kernel's plan is its launcher (``launch(a, b, out, c)``
        over the plan buffers a=0, b=1, c=2, out=3): its workspace is per stream.  ``dims`` may be PlanExprs of
        a plan family's m: the program's grid, values and tensor maps then are too."""
        fn, m = self._fn(), self.meta
        if m.needs_workspace:
            run = self.launcher(device)

            def launch(a, b, out, c):
                ptrs = (a, b, c, out)
                run([ptrs[i] for i in buffers], dims)

            return launch
        index = _device_index(device)
        _, handle = fn.bind(index)
        symbolic = any(isinstance(d, PlanExpr) for d in dims)
        grid = self.grid_of(index, self.dims.named(dims)) if symbolic else self.grid_on(index, dims)
        if any(g == 0 for g in grid if isinstance(g, int)):  # a size of 0: nothing to launch
            return [], []
        entry = self._entry_args
        args = [(PLAN_VALUE, dims[tmap]) if pos is DIM else (buffers[pos], None if tmap is None else entry.spec(tmap, dims))
                for pos, tmap in entry.sources]
        return [], [(handle, grid, m.block, fn.smem_bytes, fn.name, args)]

    def launch(self, *tensors, stream=None, **scalars):
        """Launch on explicit tensors for every parameter (inputs and outputs), checked first; the kernel's
        T.Scalars by name."""
        import torch

        m = self.meta
        if len(tensors) != len(m.params):  # zip below would drop the extra ones, or the launch the missing ones
            names = [name for name, _, _ in m.params]
            raise TypeError(f"{m.name}.launch takes {len(names)} tensors, one per parameter ({', '.join(names)}), "
                            f"got {len(tensors)}")
        for (name, _, _), t in zip(m.params, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{m.name}: parameter {name} must be a torch.Tensor, got {type(t).__name__}")
        dims = self.dims.read(tensors)
        named = self.dims.named(dims)
        device = None
        for (name, _, _), t in zip(m.params, tensors):
            if t.device.type != "cuda":
                raise ValueError(f"{m.name}: parameter {name} is on {t.device}; tile_ops kernels take CUDA tensors")
            device = device or t.device
            if t.device != device:
                raise ValueError(f"{m.name}: parameter {name} is on {t.device}, others on {device}")
        check_layouts(m, tensors, named, m.name)
        for (name, _, _), t in zip(m.params, tensors):
            if t.data_ptr() % 16:
                raise ValueError(f"{m.name}: parameter {name} must be 16-byte aligned (data_ptr % 16 == 0)")
        ptrs = [t.data_ptr() for t in tensors]
        dims = self.values(dims, **scalars)
        if stream is None:
            return self.launcher(device)(ptrs, dims)
        index = _device_index(device)
        grid = self.grid_on(index, dims)
        if 0 in grid:
            return None
        ws = None
        if m.needs_workspace:  # allocated and zeroed on the launch's stream
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                ws = workspace(index, stream, self.workspace_bytes(grid, dims))
        self._fn().launch(grid, m.block, self._entry_args.build(ptrs, index, ws.data_ptr() if ws is not None else 0,
                                                                dims), stream, index)


def workspace_bytes(meta: KernelMeta, launch_dims: "LaunchDims", grid, dims: tuple = ()) -> int:
    """A kernel's workspace for a launch of ``grid`` at the T.dynamic sizes ``dims``: the flags, then a slot of
    partials per CTA (stream-K) or the row statistics of every tile (T.row_reduce_store)."""
    named = launch_dims.named(dims)
    if grid[0] > FLAG_SLOTS:
        raise ValueError(f"{meta.name}: a stream-K launch of {grid[0]} CTAs; the workspace has flags for "
                         f"{FLAG_SLOTS}")
    flags = evaluate(meta.workspace_flags, named)
    if flags > FLAG_SLOTS:
        raise ValueError(f"{meta.name}: {launch_dims.describe(dims)}: its ops need {flags} workspace flags, more than "
                         f"the {FLAG_SLOTS} there are (e.g. T.row_reduce_store: two per row of tiles); split the "
                         f"problem along its rows")
    return (FLAG_SLOTS + evaluate(meta.workspace_fixed_floats, named) + grid[0] * meta.workspace_floats) * 4


def check_layouts(meta: KernelMeta, tensors, named: dict, who: str) -> None:
    """ValueError unless each tensor has its parameter's dtype and shape at the sizes ``named``, and its strides
    where the program gives them (else row-major)."""
    for (name, shape, dtype), t in zip(meta.params, tensors):
        shape = [evaluate(d, named) for d in shape]
        if tuple(t.shape) != tuple(shape) or str(t.dtype) != f"torch.{dtype}":
            raise ValueError(f"{who}: parameter {name} must be {dtype}{list(shape)}, got {str(t.dtype)[6:]}"
                             f"{list(t.shape)}")
        strides = meta.strides.get(name)
        if strides is None and not t.is_contiguous():
            raise ValueError(f"{who}: parameter {name} must be contiguous (row-major)")
        if strides is not None and any(n > 1 and t.stride(i) != evaluate(s, named)
                                       for i, (n, s) in enumerate(zip(t.shape, strides))):
            raise ValueError(f"{who}: parameter {name} must have strides {[evaluate(s, named) for s in strides]} "
                             f"(elements), got {list(t.stride())}")


def extent(meta: KernelMeta, pos: int, named: dict) -> int:
    """The elements parameter ``pos`` spans at the sizes ``named``: one past its last element's offset."""
    name, shape, _ = meta.params[pos]
    shape = [evaluate(d, named) for d in shape]
    strides = meta.strides.get(name)
    return math.prod(shape) if strides is None else span(shape, [evaluate(s, named) for s in strides])


class LaunchDims:
    """A kernel's T.dynamic sizes at launch (``meta.dims``): read from the shapes of the tensors that name
    them (an input's, where one does), and checked: each a multiple of its ``multiple_of``, and every tensor
    that the kernel indexes with 32-bit offsets (a pointer, not a TMA descriptor) below 2^31 elements."""

    def __init__(self, meta: KernelMeta, inputs: list):
        self.meta = meta
        self.names = [name for name, _ in meta.dims]
        self.where = {}  # name -> (param position, axis, "shape" or "stride") it is read from
        for pos in inputs + [i for i in range(len(meta.params)) if i not in inputs]:
            name = meta.params[pos][0]
            for kind, sizes in (("shape", meta.params[pos][1]), ("stride", meta.strides.get(name, ()))):
                for axis, d in enumerate(sizes):
                    if isinstance(d, str) and d in self.names:
                        self.where.setdefault(d, (pos, axis, kind))
        by_pointer = set(meta.kept) - set(meta.tensormaps)
        self.indexed = [i for i, (name, shape, _) in enumerate(meta.params) if name in by_pointer
                        and not all(isinstance(d, int) for d in (*shape, *meta.strides.get(name, ())))]

    def named(self, dims: tuple) -> dict:
        return dict(zip(self.names, dims))

    def describe(self, dims: tuple) -> str:
        return ", ".join(f"{n}={v}" for n, v in zip(self.names, dims))

    def read(self, tensors) -> tuple:
        """The sizes' values from ``tensors`` (one per parameter; None for one not allocated yet)."""
        values = []
        for name in self.names:
            pos, axis, kind = self.where[name]
            t = tensors[pos]
            if t is None or not hasattr(t, "shape") or len(t.shape) <= axis:
                pname = self.meta.params[pos][0]
                if t is None and pos in self.meta.out_idx:
                    raise ValueError(f"{self.meta.name}: T.dynamic size {name} sizes only outputs ({pname}), which a "
                                     f"call allocates: call launch() with every tensor, the outputs too")
                what = "dim" if kind == "shape" else "stride"
                raise ValueError(f"{self.meta.name}: T.dynamic size {name} is read from parameter {pname}'s "
                                 f"{what} {axis}; got {type(t).__name__ if t is None else list(t.shape)}")
            values.append(int(t.shape[axis] if kind == "shape" else t.stride(axis)))
        return tuple(values)

    def check(self, dims: tuple) -> None:
        """ValueError unless the kernel can run at these sizes."""
        m, named = self.meta, self.named(dims)
        for (name, multiple), v in zip(m.dims, dims):
            if v < 0 or v % multiple:
                raise ValueError(f"{m.name}: {name}={v}; this kernel takes {name} >= 0 and a multiple of {multiple} "
                                 f"(T.dynamic({name!r}, multiple_of={multiple}))")
        for i in self.indexed:
            name, shape, _ = m.params[i]
            if extent(m, i, named) >= 2**31:
                raise ValueError(f"{m.name}: parameter {name} has 2^31 elements or more at {self.describe(dims)}, "
                                 f"which this kernel addresses with 32-bit offsets; split the problem into parts "
                                 f"below that")


class Sized:
    """A launchable (a Kernel, or kernels launched as one) with the values of its T.dynamic sizes given:
    launched like a kernel that has none (``launch_ptrs(ptrs, device)``, ``launcher``, ``plan``), the sizes
    passed along; everything else (meta, source, sass, ...) is the launchable's."""

    def __init__(self, launchable, dims: tuple):
        self.launchable, self.dims = launchable, tuple(dims)

    def __repr__(self) -> str:
        return f"<tile_ops.Sized {self.launchable!r} at {self.dims}>"

    def __getattr__(self, name):
        return getattr(self.launchable, name)

    def dependent(self) -> "Sized":
        return Sized(self.launchable.dependent(), self.dims)

    def launch_ptrs(self, ptrs, device, dims: tuple = ()):
        self.launchable.launch_ptrs(ptrs, device, self.dims)

    def launcher(self, device):
        run, dims = self.launchable.launcher(device), self.dims
        return lambda ptrs, _dims=(): run(ptrs, dims)

    def plan(self, device, buffers, scratch=None, dims: tuple = ()):
        """The launch's plan program at its sizes, or at ``dims`` where given (PlanExprs: a plan family's)."""
        return self.launchable.plan(device, buffers, scratch, dims or self.dims)

"""A compiled kernel: CUDA source, cubin, launch geometry and a call that launches it on the
current torch stream.  Nothing here imports TVM."""

from __future__ import annotations

from dataclasses import dataclass, field

_TORCH_DTYPES = {
    "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
    "int32": "int32", "int8": "int8", "uint8": "uint8",
}


@dataclass
class KernelMeta:
    name: str
    entry: str
    arch: str
    grid: tuple
    block: tuple
    smem_bytes: int
    params: list  # [(name, shape, dtype)]
    kept: list  # parameter names the CUDA entry takes, in order
    out_idx: list
    resources: dict = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @staticmethod
    def from_json(d: dict) -> "KernelMeta":
        d = dict(d)
        d["grid"], d["block"] = tuple(d["grid"]), tuple(d["block"])
        d["params"] = [(n, tuple(s), t) for n, s, t in d["params"]]
        return KernelMeta(**d)


class Kernel:
    """``kernel(*inputs)`` allocates the outputs named by ``out_idx``, launches, and returns them."""

    def __init__(self, meta: KernelMeta, source: str, cubin: bytes):
        self.meta, self.source, self.cubin = meta, source, cubin
        self._function = None
        self._kept_pos = [i for i, (n, _, _) in enumerate(meta.params) if n in meta.kept]
        self._in_pos = [i for i in range(len(meta.params)) if i not in meta.out_idx]

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

            self._function = CudaFunction(self.cubin, self.meta.entry, self.meta.smem_bytes)
        return self._function

    def __call__(self, *inputs):
        import torch

        m = self.meta
        if len(inputs) != len(self._in_pos):
            names = [m.params[i][0] for i in self._in_pos]
            raise TypeError(f"{m.name} takes {len(names)} tensors ({', '.join(names)}), got {len(inputs)}")
        args = [None] * len(m.params)
        for pos, t in zip(self._in_pos, inputs):
            args[pos] = t
        device = inputs[0].device if inputs else torch.device("cuda", torch.cuda.current_device())
        for pos in m.out_idx:
            _, shape, dtype = m.params[pos]
            args[pos] = torch.empty(shape, dtype=getattr(torch, _TORCH_DTYPES[dtype]), device=device)
        self.launch(*args)
        outs = [args[i] for i in m.out_idx]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def launch_ptrs(self, ptrs, device):
        """Fast path for callers that validated their tensors: one pointer per parameter, in order."""
        import torch

        stream = torch.cuda.current_stream(device).cuda_stream
        self._fn().launch(self.meta.grid, self.meta.block, [ptrs[i] for i in self._kept_pos], stream,
                          device.index if device.index is not None else torch.cuda.current_device())

    def launch(self, *tensors, stream=None):
        """Launch on explicit tensors for every parameter (inputs and outputs), checked first."""
        import torch

        m = self.meta
        device = None
        for (name, shape, dtype), t in zip(m.params, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{m.name}: parameter {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type != "cuda":
                raise ValueError(f"{m.name}: parameter {name} is on {t.device}; tile_ops kernels take CUDA tensors")
            device = device or t.device
            if t.device != device:
                raise ValueError(f"{m.name}: parameter {name} is on {t.device}, others on {device}")
            if tuple(t.shape) != tuple(shape) or str(t.dtype) != f"torch.{dtype}":
                raise ValueError(f"{m.name}: parameter {name} must be {dtype}{list(shape)}, "
                                 f"got {str(t.dtype)[6:]}{list(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{m.name}: parameter {name} must be contiguous (row-major)")
            if t.data_ptr() % 16:
                raise ValueError(f"{m.name}: parameter {name} must be 16-byte aligned (data_ptr % 16 == 0)")
        ptrs = [tensors[i].data_ptr() for i in self._kept_pos]
        if stream is None:
            stream = torch.cuda.current_stream(device).cuda_stream
        self._fn().launch(m.grid, m.block, ptrs, stream, device.index)

"""Input validation shared by the tile_ops operators; each op's own checks (shapes, layouts) are in its module.

Every check raises an ordinary Python exception (``TypeError`` for wrong types or
dtypes, ``ValueError`` for shapes, scalars and layouts, ``RuntimeError`` for
device problems) whose message names the operator, says what was received and
what is accepted.  Nothing here touches tensor data, so the same checks run in
the real implementations and in the fake (meta) implementations used by
``torch.compile``.

Accepted inputs, by device:

* CUDA: float16 or bfloat16 inputs (both the same dtype), accumulation in
  float32, output float16 / bfloat16 / float32; data pointers 16-byte aligned.
* CPU (the reference path) and meta: float16, bfloat16, float32 or float64
  inputs (both the same dtype); output any of those.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

CUDA_INPUT_DTYPES = (torch.float16, torch.bfloat16)
CPU_INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CUDA_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CPU_OUT_DTYPES = CPU_INPUT_DTYPES

#: Alignment (bytes) the CUDA kernels require of every tensor's data pointer
#: (16-byte vectorized global loads / TMA).
POINTER_ALIGNMENT = 16


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]


def device_kind(device: torch.device) -> str:
    """'cuda' for CUDA tensors, 'cpu' for everything else (cpu, meta, ...)."""
    return "cuda" if device.type == "cuda" else "cpu"


def input_dtypes(kind: str):
    return CUDA_INPUT_DTYPES if kind == "cuda" else CPU_INPUT_DTYPES


def out_dtypes(kind: str):
    return CUDA_OUT_DTYPES if kind == "cuda" else CPU_OUT_DTYPES


def _accepted_inputs(kind: str) -> str:
    where = "CUDA" if kind == "cuda" else "CPU"
    return f"accepted on {where}: {dtype_names(input_dtypes(kind))}, both the same"


def check_is_tensor(op: str, name: str, t) -> None:
    """A dense tensor: the ops have no sparse, nested or quantized kernels (the dispatcher's refusal says
    nothing of what to do)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        got, fix = "a nested", f"pad it with torch.nested.to_padded_tensor({name}, 0.0), or call the op per component"
    elif t.is_quantized:
        got, fix = "a quantized", f"dequantize it with {name}.dequantize()"
    elif t.layout != torch.strided:
        got, fix = f"a {str(t.layout).replace('torch.', '')}", f"convert it with {name}.to_dense()"
    else:
        return
    raise ValueError(f"{op}: {name} must be a dense tensor (layout torch.strided), got {got} tensor ({fix})")


def check_argument_types(op: str, out_dtype=None, **tensors) -> None:
    """What the op's schema would refuse with a dispatcher message: refused here, in the op's words.
    ``tensors`` by name; None: an optional one left out."""
    for name, t in tensors.items():
        if t is not None:
            check_is_tensor(op, name, t)
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: out_dtype must be a torch.dtype or None, got {out_dtype!r}")


def autocasting(a) -> bool:
    """Whether an autocast region is active for ``a``'s device (any region at all first: 0.1 us, not 0.5)."""
    return (torch._C._is_any_autocast_enabled() and isinstance(a, torch.Tensor) and a.device.type in ("cuda", "cpu")
            and torch.is_autocast_enabled(a.device.type))


def autocast(a, *tensors):
    """Under autocast, ``a`` and ``tensors`` (None passes) in the region's lower-precision dtype, as torch's
    matmul-like ops take them: floating point tensors other than float64 are cast."""
    dtype = torch.get_autocast_dtype(a.device.type)
    return [t.to(dtype) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
            for t in (a, *tensors)]


def check_devices(op: str, tensors: Sequence[tuple[str, Optional[torch.Tensor]]]) -> torch.device:
    """All given tensors on one device; returns it."""
    present = [(n, t) for n, t in tensors if t is not None]
    name0, t0 = present[0]
    for name, t in present[1:]:
        if t.device != t0.device:
            raise RuntimeError(
                f"{op}: all tensors must be on the same device, got {name0} on {t0.device} "
                f"and {name} on {t.device} (move them with .to({str(t0.device)!r}) or "
                f".to({str(t.device)!r}); accepted devices: cuda for the tile_ops kernels, "
                f"cpu for the reference implementation)"
            )
    if t0.device.type not in ("cuda", "cpu", "meta"):
        raise RuntimeError(
            f"{op}: tensors on device {t0.device} are not supported "
            f"(accepted devices: cuda for the tile_ops kernels, cpu for the reference implementation)"
        )
    return t0.device


def check_input_dtypes(op: str, kind: str, **tensors) -> torch.dtype:
    """The one dtype of ``tensors`` (by name), one the ``kind`` of device computes in."""
    dtypes = [t.dtype for t in tensors.values()]
    if len(set(dtypes)) > 1:
        raise TypeError(
            f"{op}: {' and '.join(tensors)} must have the same dtype, got {' and '.join(map(str, dtypes))} "
            f"({_accepted_inputs(kind)})"
        )
    if dtypes[0] not in input_dtypes(kind):
        hint = ""
        if kind == "cuda" and dtypes[0] in CPU_INPUT_DTYPES:
            hint = "; cast with .half() or .bfloat16(), and use out_dtype=torch.float32 for a float32 result"
        raise TypeError(
            f"{op}: unsupported input dtype {dtypes[0]} ({_accepted_inputs(kind)}{hint})"
        )
    return dtypes[0]


def resolve_out_dtype(op: str, out_dtype: Optional[torch.dtype], in_dtype: torch.dtype, kind: str) -> torch.dtype:
    if out_dtype is None:
        return in_dtype
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"{op}: out_dtype must be a torch.dtype or None, got {out_dtype!r}")
    accepted = out_dtypes(kind)
    if out_dtype not in accepted:
        where = "CUDA" if kind == "cuda" else "CPU"
        raise TypeError(
            f"{op}: unsupported out_dtype {out_dtype} (accepted on {where}: "
            f"{dtype_names(accepted)}, or None for the input dtype)"
        )
    return out_dtype


def check_scale(op: str, scale, in_dtype: Optional[torch.dtype] = None) -> float:
    """A finite real number; for inputs other than float64, whose scores are float32, within float32's range.
    ``in_dtype`` None: the type and finiteness only."""
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{op}: scale must be a real number (a Python or NumPy float or int), "
                        f"got {type(scale).__name__}")
    if isinstance(scale, (torch.SymFloat, torch.SymInt)) or torch.compiler.is_compiling():
        return scale  # traced: the op checks it when it runs
    try:
        scale = float(scale)
    except OverflowError:  # an int past the largest float (which is below 2**1024)
        scale = math.inf
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale must be a finite float, got {scale} (accepted: any finite float)")
    f32_max = torch.finfo(torch.float32).max
    if in_dtype is not None and in_dtype != torch.float64 and abs(scale) > f32_max:
        raise ValueError(f"{op}: scale {scale:g} is beyond float32's range: the scores of {in_dtype} inputs are "
                         f"computed in float32, where it is inf (accepted: |scale| <= {f32_max:.7g}, or float64 "
                         f"inputs for a larger finite scale)")
    return scale


def op_scale(scale):
    """A checked ``scale`` as the ops' ``Scalar scale`` takes it: a Python int or float (or a traced one) as
    given, since the fast path's plans key on its type; any other real number (NumPy's, an int past int64) as
    a float, which the dispatcher would otherwise refuse."""
    if type(scale) is float or isinstance(scale, (torch.SymFloat, torch.SymInt)):
        return scale
    if type(scale) is int and -2**63 <= scale < 2**63:
        return scale
    return float(scale)


def check_alignment(op: str, name: str, t: torch.Tensor) -> None:
    """The CUDA kernels load 16-byte vectors: every data pointer must be 16-byte aligned."""
    if t.numel() == 0:
        return
    ptr = t.data_ptr()
    if ptr % POINTER_ALIGNMENT != 0:
        raise ValueError(
            f"{op}: {name}'s data pointer (0x{ptr:x}, storage offset {t.storage_offset()} "
            f"elements of {t.element_size()} bytes) is not {POINTER_ALIGNMENT}-byte aligned; the CUDA "
            f"kernels require {POINTER_ALIGNMENT}-byte aligned data pointers (accepted: tensors from "
            f"torch allocators and views starting at an aligned offset; pass {name}.clone() "
            f"to get a fresh, aligned copy)"
        )

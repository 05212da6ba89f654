"""Input validation shared by the tile_ops operators.

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


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
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
    return f"accepted on {where}: {_dtype_names(input_dtypes(kind))}, both the same"


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


def check_argument_types(op: str, a, b, bias=None, out_dtype=None) -> None:
    """What the op's schema would refuse with a dispatcher message: refused here, in the op's words."""
    check_is_tensor(op, "a", a)
    check_is_tensor(op, "b", b)
    if bias is not None:
        check_is_tensor(op, "bias", bias)
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


def check_input_dtypes(op: str, a: torch.Tensor, b: torch.Tensor, kind: str) -> torch.dtype:
    accepted = input_dtypes(kind)
    if a.dtype != b.dtype:
        raise TypeError(
            f"{op}: a and b must have the same dtype, got {a.dtype} and {b.dtype} "
            f"({_accepted_inputs(kind)})"
        )
    if a.dtype not in accepted:
        hint = ""
        if kind == "cuda" and a.dtype in CPU_INPUT_DTYPES:
            hint = "; cast with .half() or .bfloat16(), and use out_dtype=torch.float32 for a float32 result"
        raise TypeError(
            f"{op}: unsupported input dtype {a.dtype} ({_accepted_inputs(kind)}{hint})"
        )
    return a.dtype


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
            f"{_dtype_names(accepted)}, or None for the input dtype)"
        )
    return out_dtype


def check_rank(op: str, name: str, t: torch.Tensor, what: str) -> None:
    if t.dim() not in (2, 3):
        raise ValueError(
            f"{op}: {name} must be 2-D {what[0]} or 3-D batched {what[1]}, "
            f"got a {t.dim()}-D tensor of shape {tuple(t.shape)}"
        )


def check_matmul_shapes(op: str, a: torch.Tensor, b: torch.Tensor):
    """a (M, K) or (B, M, K); b (K, N) or (B, K, N). Returns (batch, M, K, N).

    ``batch`` is None when both inputs are 2-D; a 2-D operand is broadcast over
    the batch of the other one.
    """
    check_rank(op, "a", a, ("(M, K)", "(B, M, K)"))
    check_rank(op, "b", b, ("(K, N)", "(B, K, N)"))
    M, K = a.shape[-2], a.shape[-1]
    Kb, N = b.shape[-2], b.shape[-1]
    if K != Kb:
        raise ValueError(
            f"{op}: inner dimensions do not match: a has shape {tuple(a.shape)} and b has shape "
            f"{tuple(b.shape)}, but a.shape[-1] ({K}) must equal b.shape[-2] ({Kb}) "
            f"(accepted: a (M, K) or (B, M, K) with b (K, N) or (B, K, N))"
        )
    batch = None
    if a.dim() == 3 and b.dim() == 3:
        if a.shape[0] != b.shape[0]:
            raise ValueError(
                f"{op}: batch sizes do not match: a has shape {tuple(a.shape)} and b has shape "
                f"{tuple(b.shape)} (accepted: equal batch sizes, or a 2-D operand that is "
                f"broadcast over the batch of the other)"
            )
        batch = a.shape[0]
    elif a.dim() == 3:
        batch = a.shape[0]
    elif b.dim() == 3:
        batch = b.shape[0]
    return batch, M, K, N


def check_bias(
    op: str,
    bias: Optional[torch.Tensor],
    N,
    in_dtype: torch.dtype,
    out_dtype: torch.dtype,
    device: torch.device,
) -> None:
    if bias is None:
        return
    check_is_tensor(op, "bias", bias)
    if bias.device != device:
        raise RuntimeError(
            f"{op}: bias must be on the same device as a and b, got bias on {bias.device} "
            f"and a, b on {device}"
        )
    if bias.dim() != 1 or bias.shape[0] != N:
        raise ValueError(
            f"{op}: bias must be 1-D of shape (N,) = ({N},), one value per output column, "
            f"got shape {tuple(bias.shape)}"
        )
    accepted = [in_dtype] if in_dtype == out_dtype else [in_dtype, out_dtype]
    if bias.dtype not in accepted:
        raise TypeError(
            f"{op}: bias dtype {bias.dtype} does not match the inputs (accepted: "
            f"{_dtype_names(accepted)}, the input dtype or the output dtype)"
        )


def check_scale(op: str, scale, in_dtype: Optional[torch.dtype] = None) -> float:
    """A finite real number; for inputs other than float64, whose scores are float32, within float32's range.
    ``in_dtype`` None: the type and finiteness only."""
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{op}: scale must be a real number (a Python or NumPy float or int), "
                        f"got {type(scale).__name__}")
    if isinstance(scale, torch.SymFloat) or torch.compiler.is_compiling():  # traced: the op checks it when it runs
        return scale
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


def check_matmul_inputs(
    op: str,
    a,
    b,
    bias=None,
    out_dtype: Optional[torch.dtype] = None,
    kind: Optional[str] = None,
):
    """All data-independent checks for ``a @ b (+ bias)``.

    Returns (device, batch, M, K, N, out_dtype).  ``kind`` overrides the device
    kind whose dtype rules apply ('cuda' or 'cpu'); by default it is taken from
    the device of ``a``.
    """
    check_is_tensor(op, "a", a)
    check_is_tensor(op, "b", b)
    device = check_devices(op, [("a", a), ("b", b)] + ([("bias", bias)] if isinstance(bias, torch.Tensor) else []))
    if kind is None:
        kind = device_kind(device)
    in_dtype = check_input_dtypes(op, a, b, kind)
    odt = resolve_out_dtype(op, out_dtype, in_dtype, kind)
    batch, M, K, N = check_matmul_shapes(op, a, b)
    check_bias(op, bias, N, in_dtype, odt, device)
    return device, batch, M, K, N, odt


def output_shape(batch, M, N):
    return (M, N) if batch is None else (batch, M, N)


# --------------------------------------------------------------------------- layouts


def kernel_layout(t: torch.Tensor) -> Optional[str]:
    """Layout of the last two dims of ``t`` as the kernels see them.

    'row' for row-major (stride(-1) == 1 and stride(-2) == cols), 'col' for a
    plain transpose of a row-major matrix (stride(-2) == 1 and
    stride(-1) == rows), None for anything else.  Strides of size-1 dims do not
    matter (see ``canonical_view``).
    """
    R, C = t.shape[-2], t.shape[-1]
    sr, sc = t.stride(-2), t.stride(-1)
    if (C == 1 or sc == 1) and (R == 1 or sr == C):
        return "row"
    if (R == 1 or sr == 1) and (C == 1 or sc == R):
        return "col"
    return None


def canonical_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """Same data as ``t`` (3-D), with the exact strides of ``layout`` in the last two dims.

    Only rewrites the strides of size-1 dims, which address no other element;
    the batch stride is kept (0 for a broadcast operand; normalized to the
    matrix size when the batch has a single entry).
    """
    Bt, R, C = t.shape
    if layout == "row":
        strides = (t.stride(0) if Bt > 1 else R * C, C, 1)
    else:
        strides = (t.stride(0) if Bt > 1 else R * C, 1, R)
    if tuple(t.stride()) == strides:
        return t
    return t.as_strided((Bt, R, C), strides, t.storage_offset())


def as_kernel_operand(t: torch.Tensor) -> torch.Tensor:
    """A 3-D view of ``t`` that the kernels accept: last two dims row-major or plain transposed.

    Views that are neither (e.g. ``x[:, ::2]`` or a row pitch larger than the
    row) are copied with ``.contiguous()``; this is the only case in which an
    operand is copied.
    """
    if t.dim() == 2:
        t = t.unsqueeze(0)
    layout = kernel_layout(t)
    if layout is None:
        t = t.contiguous()
        layout = "row"
    return canonical_view(t, layout)

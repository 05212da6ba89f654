"""What the matmul-like ops (gemm, gemm_softmax: ``a (..., M, K) @ b (..., K, N)``) check of their inputs and how
their CUDA paths lay operands out for the kernels.  The checks raise as ``checks.py``'s do."""

from __future__ import annotations

from typing import Optional

import torch

from . import checks


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the CPU references and the tangents compute in: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
    checks.check_is_tensor(op, "bias", bias)
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
            f"{checks.dtype_names(accepted)}, the input dtype or the output dtype)"
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
    checks.check_is_tensor(op, "a", a)
    checks.check_is_tensor(op, "b", b)
    device = checks.check_devices(op, [("a", a), ("b", b)] + ([("bias", bias)] if isinstance(bias, torch.Tensor)
                                                               else []))
    if kind is None:
        kind = checks.device_kind(device)
    in_dtype = checks.check_input_dtypes(op, kind, a=a, b=b)
    odt = checks.resolve_out_dtype(op, out_dtype, in_dtype, kind)
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


def random_operands(M, N, K, dtype, device):
    """Random A (M, K) and B (K, N) scaled so that A @ B has entries of about unit size."""
    s = K ** -0.25
    return (torch.randn(M, K, device=device) * s).to(dtype), (torch.randn(K, N, device=device) * s).to(dtype)

"""``torch.ops.tile_ops.gemm``: (batched) matrix multiply with an optional bias epilogue.

Schema::

    tile_ops::gemm(Tensor a, Tensor b, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor

Implementations:

* CUDA: validates, allocates the output and launches ``tile_ops.kernels.gemm``
  (fp16/bf16 inputs, fp32 accumulation, bias added in the epilogue; with a
  split-K config, two kernels: fp32 partials, then their sum + bias; on sm_90a
  an operand whose rows are not 16-byte multiples is first copied into padded
  rows that TMA can load).  Operands
  whose last two dims are row-major or a plain transpose (``x.t()``,
  ``x.transpose(-1, -2)``, ``x.mT``) go to the kernel as they are, through its
  transpose flags; any other strided view (e.g. ``x[:, ::2]``) is copied with
  ``.contiguous()`` first.  Data pointers must be 16-byte aligned.  A call
  whose signature was launched before runs from its recorded plan
  (``fastpath``); ``tile_ops.gemm`` does so without the dispatcher when it
  adds nothing (eager, no autograd graph, plain tensors).
* CPU: the reference in plain torch, computed in float32 (float64 for float64
  inputs); accepts float16, bfloat16, float32 and float64.
* Fake/meta: shapes and dtypes only, for ``torch.compile``.
* Autograd: ``dA = dC @ B^T`` and ``dB = A^T @ dC``, both computed with
  ``tile_ops.gemm`` itself on transposed views; ``dbias`` = ``dC`` summed over
  rows.
"""

import functools
import importlib
from typing import Optional

import torch

from . import checks, dense_only, fastpath, forward_ad, functorch, matmul, sharding

OP = "tile_ops.gemm"

# the plan's buffers (fastpath.py): the signature's tensors, the output, the scratch buffers
A, B, BIAS, OUT, SCRATCH = range(5)

GEMM_SCHEMA = "(Tensor a, Tensor b, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor"


def load_kernel_module(name: str, op: str):
    """Import ``tile_ops.kernels.<name>`` lazily (only the CUDA path needs it)."""
    try:
        return importlib.import_module(f"tile_ops.kernels.{name}")
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise RuntimeError(
            f"{op}: the CUDA kernels are unavailable: importing tile_ops.kernels.{name} failed "
            f"({type(e).__name__}: {e}); the CPU implementation is still available for CPU tensors"
        ) from e


# --------------------------------------------------------------------------- CPU reference


def gemm_reference(a, b, bias=None, out_dtype=None):
    """Plain-torch reference: ``(a @ b + bias)`` computed in float32 (float64 for float64)."""
    _, _, _, _, _, odt = matmul.check_matmul_inputs(OP, a, b, bias, out_dtype)
    cdt = matmul.compute_dtype(a.dtype)
    acc = torch.matmul(a.to(cdt), b.to(cdt))
    if bias is not None:
        acc = acc + bias.to(cdt)
    return acc.to(odt).contiguous()


@torch.library.custom_op("tile_ops::gemm", mutates_args=(), device_types="cpu", schema=GEMM_SCHEMA)
def _gemm_cpu(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    return gemm_reference(a, b, bias, out_dtype)


gemm_op = _gemm_cpu


# --------------------------------------------------------------------------- CUDA


def prepare_gemm_launch(a, b, bias=None, out_dtype=None, kind: str = "cuda"):
    """Validate and lay out a gemm for ``launch_gemm``.

    Returns ``(out, launch_args)`` where ``out`` is the (contiguous) result
    tensor and ``launch_args`` is ``None`` when there is nothing to launch
    (empty result, or K == 0 where the result is zeros / the bias, already
    written), else ``(a3, b3, out3, bias)`` for
    ``tile_ops.kernels.gemm_launch.launch_gemm``:

    * ``a3`` (Bt, M, K) and ``b3`` (Bt, K, N): last two dims row-major or a plain
      transpose (exact strides), batch stride anything (0 for a broadcast 2-D
      operand); 16-byte aligned data pointers.
    * ``out3`` (Bt, M, N): a contiguous view of ``out``.
    * ``bias``: (N,) contiguous, in its own dtype (the input or the output dtype), or None.

    A 3-D ``a`` with row-major rows and a 2-D ``b`` is folded into a single
    (1, B*M, K) problem.
    """
    _, batch, M, K, N, odt = matmul.check_matmul_inputs(OP, a, b, bias, out_dtype, kind=kind)
    out = torch.empty(matmul.output_shape(batch, M, N), dtype=odt, device=a.device)
    if out.numel() == 0:
        return out, None
    if K == 0:
        if bias is None:
            out.zero_()
        else:
            out.copy_(bias.expand(out.shape))
        return out, None

    if bias is not None:
        bias = bias.contiguous()  # in its own dtype (the input's or the output's): the epilogue adds it in fp32
        if bias.data_ptr() % checks.POINTER_ALIGNMENT:  # a view into a larger buffer: N values are cheap to copy
            bias = bias.clone()

    if (
        a.dim() == 3
        and b.dim() == 2
        and matmul.kernel_layout(a) == "row"
        and (a.shape[0] == 1 or a.stride(0) == M * K)
    ):
        # (B, M, K) @ (K, N) with a row-major batch: one (B*M, K) @ (K, N) problem.
        a3 = a.as_strided((1, batch * M, K), (batch * M * K, K, 1), a.storage_offset())
        b3 = matmul.as_kernel_operand(b)
        out3 = out.view(1, batch * M, N)
    else:
        Bt = 1 if batch is None else batch
        a3 = matmul.as_kernel_operand(a)
        b3 = matmul.as_kernel_operand(b)
        if a3.shape[0] != Bt:
            a3 = a3.expand(Bt, M, K)
        if b3.shape[0] != Bt:
            b3 = b3.expand(Bt, K, N)
        out3 = out.view(Bt, M, N)
    checks.check_alignment(OP, "a", a3)
    checks.check_alignment(OP, "b", b3)
    return out, (a3, b3, out3, bias)


def _gemm_cuda_checked(a, b, bias, out_dtype):
    """Validate, lay out and launch; record the call's plan when the kernel reads the caller's tensors."""
    out, launch_args = prepare_gemm_launch(a, b, bias, out_dtype, kind="cuda")
    if launch_args is None:
        return out
    a3, b3, out3, bias3 = launch_args
    kernels = load_kernel_module("gemm_launch", OP)
    with torch.cuda.device(a.device):  # the JIT compiles for the current device's arch
        kernel, a3, b3 = kernels.get_gemm_kernel(a3, b3, out3, bias3)
    launch = kernels.gemm_launcher(kernel, a.device)
    launch(a3.data_ptr(), b3.data_ptr(), out3.data_ptr(), 0 if bias3 is None else bias3.data_ptr())
    operands = (a3, b3, out3) if bias is None else (a3, b3, out3, bias3)
    callers = (a, b, out) if bias is None else (a, b, out, bias)
    if fastpath.launched_in_place(operands, callers):
        program = kernels.gemm_plan(kernel, a.device, A, B, OUT, None if bias is None else BIAS, SCRATCH)
        fastpath.record(fastpath.GEMM, (a, b, bias), (out_dtype,), (out,), program)
    return out


def _gemm_cuda(a, b, bias=None, out_dtype=None):
    out = fastpath.call(fastpath.GEMM, (a, b, bias), (out_dtype,), False)
    return out if out is not None else _gemm_cuda_checked(a, b, bias, out_dtype)


gemm_op.register_kernel("cuda", _gemm_cuda)


# --------------------------------------------------------------------------- fake


@gemm_op.register_fake
def _gemm_fake(a, b, bias=None, out_dtype=None):
    _, batch, M, K, N, odt = matmul.check_matmul_inputs(OP, a, b, bias, out_dtype)
    return a.new_empty(matmul.output_shape(batch, M, N), dtype=odt)


# --------------------------------------------------------------------------- autograd


def matmul_input_grads(grad, a, b, need_a: bool, need_b: bool, a_dim: int, b_dim: int):
    """Gradients of ``a @ b`` for an upstream ``grad`` (already in the input dtype).

    ``dA = grad @ B^T`` and ``dB = A^T @ grad`` through ``tile_ops.gemm`` (the
    op, or its fast path when the backward builds no graph) on transposed
    views; a 2-D operand broadcast over a batch gets its gradient summed over
    that batch.
    """
    da = db = None
    batched = grad.dim() == 3
    if need_a:
        da = gemm(grad, b.transpose(-1, -2))
        if batched and a_dim == 2:
            da = da.sum(0)
    if need_b:
        if batched and b_dim == 2:
            # sum_i a_i^T @ g_i == (a as (B*M, K))^T @ (g as (B*M, N)); reshape, not flatten: the batched
            # gradients of autograd.grad(is_grads_batched=True) have no batching rule for flatten
            B, M, K = a.shape
            db = gemm(a.reshape(B * M, K).transpose(0, 1), grad.reshape(B * M, grad.shape[-1]))
        else:
            db = gemm(a.transpose(-1, -2), grad)
    return da, db


def needs_input_grad(ctx, n):
    """The first ``n`` entries of ``ctx.needs_input_grad``.

    The dispatcher drops trailing arguments equal to their defaults before the
    autograd function sees them, so omitted ones (e.g. ``bias=None``) read as False.
    """
    flags = tuple(ctx.needs_input_grad)
    return (flags + (False,) * n)[:n]


def _gemm_setup_context(ctx, inputs, output):
    a, b, bias, out_dtype = inputs
    need_a, need_b = needs_input_grad(ctx, 2)
    # dA needs only B, dB needs only A.
    ctx.save_for_backward(b if need_a else None, a if need_b else None)
    ctx.a_dim, ctx.b_dim = a.dim(), b.dim()
    ctx.in_dtype = a.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _gemm_backward(ctx, grad):
    b, a = ctx.saved_tensors[:2]
    need_a, need_b, need_bias = needs_input_grad(ctx, 3)
    g = grad.to(ctx.in_dtype)
    da, db = matmul_input_grads(g, a, b, need_a, need_b, ctx.a_dim, ctx.b_dim)
    dbias = None
    if need_bias and ctx.bias_dtype is not None:
        rows = tuple(range(grad.dim() - 1))  # (not flatten: see matmul_input_grads)
        dbias = grad.sum(rows, dtype=matmul.compute_dtype(grad.dtype)).to(ctx.bias_dtype)
    return da, db, dbias, None


gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


def _gemm_op_jvp(a, b, bias=None, out_dtype=None):
    """The op's own forward mode (the op called directly): the tangent from the ops, not the wrappers."""
    return forward_ad.gemm_jvp(torch.ops.tile_ops.gemm, a, b, bias, out_dtype)


forward_ad.register_forward_mode(gemm_op, _gemm_op_jvp)
dense_only.refuse_non_dense("gemm", OP)


def _gemm_jvp(ctx, ta, tb, tbias, _):
    b, a, y = ctx.saved_tensors
    return forward_ad.gemm_tangent(gemm, a, b, ta, tb, tbias, y.dtype, y)


gemm_op.register_vmap(functorch.gemm_vmap_rule(gemm_op, matmul.compute_dtype,
                                                functools.partial(matmul.check_matmul_inputs, OP)))
_GemmFunction = functorch.autograd_function(  # torch.func and forward mode, eagerly: the same formulas
    "GemmFunction", gemm_op, _gemm_setup_context, _gemm_backward,
    lambda inputs, y: (inputs[1], inputs[0], y), _gemm_jvp)  # (b, a) as the op's backward reads them, then y


# --------------------------------------------------------------------------- public API


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Matrix multiply ``a @ b (+ bias)`` with tile_ops kernels.

    Args:
        a: ``(M, K)`` or batched ``(B, M, K)``.
        b: ``(K, N)`` or batched ``(B, K, N)``.  A 2-D operand is broadcast over
            the batch of the other one.  Transposed views (``x.t()``, ``x.mT``)
            are read in place through the kernel's transpose flags; other
            strided views (e.g. ``x[:, ::2]``) are copied with ``.contiguous()``.
        bias: optional ``(N,)``, added to every row in the kernel's epilogue
            (before the cast to the output dtype).  Its dtype is the input dtype
            or the output dtype.
        out_dtype: dtype of the result; defaults to the input dtype.

    Returns:
        ``(M, N)`` or ``(B, M, N)``, contiguous, in ``out_dtype``.

    Devices and dtypes:
        CUDA: ``a`` and ``b`` both float16 or both bfloat16, accumulated in
        float32; ``out_dtype`` float16, bfloat16 or float32; data pointers must
        be 16-byte aligned.  CPU: the plain-torch reference, which also accepts
        float32 and float64 (computed in float32, or float64 for float64).

    Empty problems are valid: ``M == 0``, ``N == 0`` or ``B == 0`` give an
    empty result and ``K == 0`` gives zeros (plus ``bias``), without a launch.

    Differentiable in ``a``, ``b`` and ``bias``; the backward runs two gemms.
    Forward mode too (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``),
    one level, also inside ``torch.compile`` and through ``torch.ops.tile_ops.gemm`` itself
    (exported programs): the tangent is ``da @ b + a @ db + dbias``, from three gemms; nested
    forward levels are refused.  ``torch.func`` eagerly: ``grad``,
    ``vjp``, ``jacrev``, ``hessian`` and ``vmap`` (one launch over the mapped dim), composed
    (per-sample gradients); inside ``torch.compile``, ``vmap`` and ``jvp``.
    Works under ``torch.compile(fullgraph=True)``.  Under ``torch.autocast``,
    floating point operands (not float64) are cast to the region's dtype first,
    as for ``torch.matmul``.  With DTensor operands (tensor parallelism) each
    rank runs it on its shards (``tile_ops/ops/sharding.py``).

    Calls ``torch.ops.tile_ops.gemm``, except for a repeated CUDA call that
    the dispatcher would add nothing to (eager, no autograd graph, plain
    tensors): that one launches the kernel recorded for its signature directly.
    """
    eager = not torch.compiler.is_compiling()  # dynamo folds this to True and traces the op instead
    casting = checks.autocasting(a)
    if eager and not casting and not forward_ad.plain_operands_may_be_dual():
        out = fastpath.call(fastpath.GEMM, (a, b, bias), (out_dtype,), True)
        if out is not None:
            return out
    checks.check_argument_types(OP, out_dtype, a=a, b=b, bias=bias)
    if casting:
        a, b, bias = checks.autocast(a, b, bias)
    if eager:
        sharding.register_if_in_use()
    else:  # run by dynamo while it traces, not put in the graph
        sharding.register_when_traced()
    if forward_ad.active():  # a forward level or a torch.func transform
        if eager:  # (under torch.compile, dynamo traces the tangent below instead)
            forward_ad.refuse_nested_levels(OP)
            return _GemmFunction.apply(a, b, bias, out_dtype)
        functorch.refuse_traced_grad(OP)
        dual = forward_ad.gemm_jvp(gemm, a, b, bias, out_dtype)
        if dual is not None:
            return dual
    return torch.ops.tile_ops.gemm(a, b, bias, out_dtype)

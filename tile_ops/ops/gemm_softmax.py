"""``torch.ops.tile_ops.gemm_softmax``: ``softmax(scale * (a @ b), dim=-1)`` in one fused kernel.

Schema::

    tile_ops::gemm_softmax(Tensor a, Tensor b, Scalar scale=1.0, ScalarType? out_dtype=None) -> Tensor

``scale`` is a ``Scalar``, not a ``float``: the dispatcher converts a bool or a one-element tensor to a
float before any implementation sees it, whereas a ``Scalar`` reaches the checks as given (a bool, refused)
and the dispatcher refuses a tensor itself, naming ``scale``.

Implementations:

* CUDA: validates, allocates the output and launches
  ``tile_ops.kernels.gemm_softmax`` (fp16/bf16 inputs, fp32 accumulation and
  softmax).  The kernel reads row-major operands, so views that are not
  row-major (transposes included) are copied with ``.contiguous()``.  A batched
  ``a`` with row-major rows and a 2-D ``b`` runs as one (B*M, K) problem (the
  softmax is per row); other batched problems launch the kernel once per batch
  entry.  Data pointers must be 16-byte aligned.  A call whose signature was
  launched before in a single launch runs from its recorded plan
  (``fastpath``); ``tile_ops.gemm_softmax`` does so without the dispatcher
  when it adds nothing (eager, no autograd graph, plain tensors).
* CPU: the reference in plain torch, in float32 (float64 for float64 inputs).
* Fake/meta: shapes and dtypes only, for ``torch.compile``.
* Autograd: with ``P`` the output and ``dP`` its gradient,
  ``dS = scale * P * (dP - rowsum(dP * P))``, then ``da = dS @ b^T`` and
  ``db = a^T @ dS`` with ``torch.ops.tile_ops.gemm``.  Saves ``P`` and only the
  operands the requested gradients need.  Forward mode: ``dp = p * (dz -
  sum(p * dz))`` with ``dz = scale * (da @ b + a @ db)``; vmap: one call over
  the mapped dim (rows are independent).

Everything the library's generic parts need of it is its ``OpSpec``, ``GEMM_SOFTMAX``, at the end.
"""

from typing import Optional

import torch

from ..autotune import targets
from . import checks, fastpath, forward_ad, functorch, matmul, spec
from .gemm import matmul_input_grads, needs_input_grad

OP = "tile_ops.gemm_softmax"

# the plan's buffers (fastpath.py): the signature's tensors, the output
A, B, OUT = range(3)


def _kernels():
    """``tile_ops.kernels.gemm_softmax_launch``, imported at the first CUDA launch: the CPU path imports no kernel
    (nor TVM)."""
    from ..kernels import gemm_softmax_launch

    return gemm_softmax_launch


def _check(a, b, scale, out_dtype, kind=None):
    out = matmul.check_matmul_inputs(OP, a, b, None, out_dtype, kind=kind)
    scale = checks.check_scale(OP, scale, a.dtype)
    return out, scale


# --------------------------------------------------------------------------- CPU reference and fake


def gemm_softmax_reference(a, b, scale=1.0, out_dtype=None):
    """Plain-torch reference: ``softmax(scale * (a @ b), -1)`` in float32 (float64 for float64)."""
    (_, _, _, _, _, odt), scale = _check(a, b, scale, out_dtype)
    cdt = matmul.compute_dtype(a.dtype)
    s = torch.matmul(a.to(cdt), b.to(cdt)) * scale
    return torch.softmax(s, dim=-1).to(odt).contiguous()


def _gemm_softmax_fake(a, b, scale=1.0, out_dtype=None):
    (_, batch, M, K, N, odt), _ = _check(a, b, scale, out_dtype)
    return a.new_empty(matmul.output_shape(batch, M, N), dtype=odt)


# --------------------------------------------------------------------------- CUDA


def _padded_empty(B, R, C, dtype, device):
    """(B, R, C) row-major tensor whose batch entries all start 16-byte aligned."""
    esize = torch.empty((), dtype=dtype).element_size()
    align = max(1, checks.POINTER_ALIGNMENT // esize)
    pitch = -(-(R * C) // align) * align
    buf = torch.empty(B * pitch, dtype=dtype, device=device)
    return buf.as_strided((B, R, C), (pitch, C, 1))


def _slices(t, B):
    """Per-batch 2-D operands of a row-major ``t`` (2-D: broadcast), each 16-byte aligned."""
    if t.dim() == 2:
        return [t] * B
    if B > 1 and (t.stride(0) * t.element_size()) % checks.POINTER_ALIGNMENT != 0:
        padded = _padded_empty(B, t.shape[1], t.shape[2], t.dtype, t.device)
        padded.copy_(t)
        t = padded
    return list(t.unbind(0))


def prepare_gemm_softmax_launch(a, b, scale=1.0, out_dtype=None, kind: str = "cuda"):
    """Validate and lay out a gemm_softmax for ``launch_gemm_softmax``.

    Returns ``(out, launches, finish)``: ``out`` is the contiguous result,
    ``launches`` a list of ``(a2, b2, out2, scale)`` argument tuples (2-D,
    row-major, 16-byte aligned), and ``finish`` a callable to run after the
    launches (copies results written to an aligned scratch buffer into ``out``),
    or None.
    """
    (_, batch, M, K, N, odt), scale = _check(a, b, scale, out_dtype, kind=kind)
    out = torch.empty(matmul.output_shape(batch, M, N), dtype=odt, device=a.device)
    if out.numel() == 0:
        return out, [], None
    if K == 0:
        out.fill_(1.0 / N)  # softmax of a zero row is uniform
        return out, [], None

    a = a if a.is_contiguous() else a.contiguous()
    b = b if b.is_contiguous() else b.contiguous()
    checks.check_alignment(OP, "a", a)
    checks.check_alignment(OP, "b", b)

    if batch is None:
        return out, [(a, b, out, scale)], None
    if a.dim() == 3 and b.dim() == 2:
        # Row-wise softmax: (B, M, K) @ (K, N) is one (B*M, K) @ (K, N) problem.
        return out, [(a.view(batch * M, K), b, out.view(batch * M, N), scale)], None

    a_s, b_s = _slices(a, batch), _slices(b, batch)
    finish = None
    dst = out
    if batch > 1 and (M * N * out.element_size()) % checks.POINTER_ALIGNMENT != 0:
        dst = _padded_empty(batch, M, N, odt, out.device)

        def finish():
            out.copy_(dst)

    launches = [(a_s[i], b_s[i], dst[i], scale) for i in range(batch)]
    return out, launches, finish


def _gemm_softmax_cuda_checked(a, b, scale=1.0, out_dtype=None):
    """Validate, lay out and launch; record the call's plan when one launch reads the caller's tensors."""
    out, launches, finish = prepare_gemm_softmax_launch(a, b, scale, out_dtype, kind="cuda")
    if not launches:
        return out
    kernels = _kernels()
    with torch.cuda.device(a.device):  # the JIT compiles for the current device's arch
        for a2, b2, out2, s in launches:
            kernel = kernels.get_gemm_softmax_kernel(a2, b2, out2, s)
            kernels.gemm_softmax_launcher(kernel, a.device)(a2.data_ptr(), b2.data_ptr(), out2.data_ptr())
        if finish is not None:
            finish()
    if len(launches) == 1 and fastpath.launched_in_place((a2, b2, out2), (a, b, out)):
        program = kernels.gemm_softmax_plan(kernel, a.device, A, B, OUT)
        fastpath.record(GEMM_SOFTMAX.plan_id, *_signature(a, b, scale, out_dtype), (out,), program)
        if getattr(kernels, "family_ranges", None):  # (the tests' CPU stand-ins have none)
            dims = kernel.dims if isinstance(kernel, kernels.Sized) else ()  # M at run time
            fastpath.record_row_family(
                GEMM_SOFTMAX.plan_id, _signature(a, b, scale, out_dtype), a, out, dims,
                lambda dims: kernels.gemm_softmax_plan(kernel, a.device, A, B, OUT, dims=dims),
                lambda fold: kernels.family_ranges(kernels.softmax_problem(a2, b2, out2, s), fold, a.device))
    return out


def _gemm_softmax_problem(a, b, scale=1.0, out_dtype=None) -> list:
    """The kernel problems of a call (record.py): what the CUDA path launches for it, on either device."""
    _, launches, _ = prepare_gemm_softmax_launch(a, b, scale, out_dtype, kind="cuda")
    return [_kernels().softmax_problem(*launch) for launch in launches[:1]]  # (the batch's launches are alike)


def _signature(a, b, scale=1.0, out_dtype=None):
    """(tensors, flags): what a call's plan is keyed on (the wrapper's fast path spells it out)."""
    return (a, b), (scale, out_dtype)


# --------------------------------------------------------------------------- autograd


def _gemm_softmax_setup_context(ctx, inputs, output):
    a, b, scale, out_dtype = inputs
    need_a, need_b = needs_input_grad(ctx, 2)
    # P is needed for dS; da needs b, db needs a.
    ctx.save_for_backward(output, b if need_a else None, a if need_b else None)
    ctx.scale = scale
    ctx.a_dim, ctx.b_dim = a.dim(), b.dim()
    ctx.in_dtype = a.dtype


def softmax_backward(P, dP, scale, dtype):
    """``dS = scale * P * (dP - rowsum(dP * P))``, computed in float32 (float64 for float64)."""
    cdt = matmul.compute_dtype(P.dtype if P.dtype == torch.float64 else dP.dtype)
    Pc, g = P.to(cdt), dP.to(cdt)
    dS = Pc * (g - (g * Pc).sum(-1, keepdim=True))
    return (dS * scale).to(dtype)


def _gemm_softmax_backward(ctx, grad):
    P, b, a = ctx.saved_tensors
    need_a, need_b = needs_input_grad(ctx, 2)
    if not (need_a or need_b):
        return None, None, None, None
    dS = softmax_backward(P, grad, ctx.scale, ctx.in_dtype)
    da, db = matmul_input_grads(dS, a, b, need_a, need_b, ctx.a_dim, ctx.b_dim)
    return da, db, None, None


# --------------------------------------------------------------------------- forward mode and vmap


def _gemm_softmax_tangent(ops, args, tangents, p):
    """The tangent of ``p = gemm_softmax(a, b, scale)``, computed in the scores' precision."""
    (a, b, scale, _), (ta, tb, *_) = args, tangents
    wide = torch.float32 if a.dtype in (torch.float16, torch.bfloat16) else a.dtype
    dz = scale * forward_ad.sum_terms([ops.gemm(ta, b, None, wide) if ta is not None else None,
                                       ops.gemm(a, tb, None, wide) if tb is not None else None])
    pw = p.to(wide)
    return (pw * (dz - (pw * dz).sum(-1, keepdim=True))).to(p.dtype)


def _gemm_softmax_jvp(ctx, ta, tb, *_):
    p, b, a = ctx.saved_tensors
    return _gemm_softmax_tangent(spec.WRAPPERS, (a, b, ctx.scale, None), (ta, tb), p)


def _gemm_softmax_vmap(info, in_dims, a, b, scale=1.0, out_dtype=None):
    """Rows are independent, so one call over the mapped dim (after the checks see a slice, as for gemm)."""
    _check(functorch.one_slice(a, in_dims[0]), functorch.one_slice(b, in_dims[1]), scale, out_dtype)
    return functorch.batched_matmul(lambda x, y: GEMM_SOFTMAX.op(x, y, scale, out_dtype), a, b, *in_dims[:2]), 0


# --------------------------------------------------------------------------- the autotuner and the CLI


class GemmSoftmaxTarget(targets.Target):
    scaled = True
    speed = "us"
    demo = [((8192, 2048, 1024), "float16"), ((1000, 200, 96), "float16")]
    demo_quick = [((200, 96, 64), "float16")]
    precompile = [(8192, 2048, 1024)]  # bench_gemm_softmax.py's main shape

    def configs(self):
        from ..kernels import gemm_softmax_config, gemm_softmax_defaults, gemm_softmax_space

        return targets.KernelConfigs(gemm_softmax_config.SoftmaxConfig, gemm_softmax_space.config_space,
                                     gemm_softmax_defaults.default_config, gemm_softmax_config.shared_memory_bytes)

    def compile(self, shape, dtype: str, cfg, arch: str):
        from ..kernels.gemm_softmax_launch import build_gemm_softmax

        return build_gemm_softmax(*shape, 1.0, dtype, dtype, cfg, target=arch)

    def problem(self, shape, dtype: str, scale: float = 1.0) -> dict:
        M, N, K = shape
        return dict(M=M, N=N, K=K, scale=float(scale), dtype=dtype, out_dtype=dtype)

    def kernel_call(self, problem: dict, arch: str):
        from ..kernels.gemm_softmax import gemm_softmax as program

        kernels = _kernels()
        cfg = kernels.problem_config(problem, arch=arch)
        return ((program, *kernels.gemm_softmax_call(*kernels.problem_args(problem), cfg)),
                lambda: kernels.build_problem(problem, cfg, arch=arch))

    def inputs(self, shape, dtype: str, device):
        M, N, K = shape
        dt = getattr(torch, dtype)
        a, b = matmul.random_operands(M, N, K, dt, device)
        return [a, b, torch.empty(M, N, dtype=dt, device=device)]

    def reference(self, args, scale: float = 1.0, dtype=None):
        dtype = dtype or torch.float32
        return torch.softmax(scale * torch.matmul(args[0].to(dtype), args[1].to(dtype)), dim=-1)

    def torch_equivalent(self, args, scale: float):
        return lambda: torch.softmax(scale * (args[0] @ args[1]), -1)

    def flops(self, shape) -> int:  # the product's (the softmax adds a few per score)
        M, N, K = shape
        return 2 * M * N * K


# --------------------------------------------------------------------------- public API


def gemm_softmax(
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Fused ``softmax(scale * (a @ b), dim=-1)``.

    Args:
        a: ``(M, K)`` or batched ``(B, M, K)``.
        b: ``(K, N)`` or batched ``(B, K, N)``; a 2-D operand is broadcast over
            the batch of the other one.
        scale: finite real multiplier applied to ``a @ b`` before the softmax;
            within float32's range unless the inputs are float64 (the scores
            of other inputs are float32).
        out_dtype: dtype of the result; defaults to the input dtype.

    Returns:
        ``(M, N)`` or ``(B, M, N)``, contiguous, in ``out_dtype``; every row sums to 1.

    Devices and dtypes:
        CUDA: ``a`` and ``b`` both float16 or both bfloat16; the product and the
        softmax are computed in float32 in one kernel (the ``M x N`` scores are
        never written to memory); ``out_dtype`` float16, bfloat16 or float32;
        16-byte aligned data pointers.  Non-row-major views are copied with
        ``.contiguous()``.  CPU: the plain-torch reference, which also accepts
        float32 and float64.

    ``M == 0``, ``N == 0`` or ``B == 0`` give an empty result; ``K == 0`` gives
    the uniform distribution ``1 / N``.

    Differentiable in ``a`` and ``b`` (softmax backward, then two gemms).
    Forward mode too (``torch.func.jvp``, ``jacfwd``, ``torch.autograd.forward_ad``),
    one level, also inside ``torch.compile`` and through the op itself (nested levels are
    refused).  ``torch.func`` eagerly, as for ``tile_ops.gemm``: ``grad``, ``vjp``, ``jacrev``,
    ``hessian``, ``vmap``.
    Works under ``torch.compile(fullgraph=True)``.  Under ``torch.autocast``
    the operands are cast to the region's dtype, and on CUDA the result is
    float32 unless ``out_dtype`` says otherwise: what ``softmax(a @ b)`` gives.

    Calls ``torch.ops.tile_ops.gemm_softmax``, except for a repeated CUDA call
    that the dispatcher would add nothing to (eager, no autograd graph, plain
    tensors): that one launches the kernel recorded for its signature directly.
    """
    eager = not torch.compiler.is_compiling()  # dynamo folds this to True and traces the op instead
    casting = checks.autocasting(a)
    if eager and not casting and not forward_ad.plain_operands_may_be_dual():
        out = fastpath.call(GEMM_SOFTMAX.plan_id, (a, b), (scale, out_dtype), True)  # _signature, inline: 0.3 µs less
        if out is not None:
            return out
    checks.check_argument_types(OP, out_dtype, a=a, b=b)
    checks.check_scale(OP, scale, a.dtype)
    scale = checks.op_scale(scale)
    if casting:  # the product in the region's dtype; softmax runs in float32 under CUDA's autocast
        out_dtype = out_dtype or (torch.float32 if a.device.type == "cuda" else None)
        a, b = checks.autocast(a, b)
    out = spec.transformed(GEMM_SOFTMAX, gemm_softmax, (a, b, scale, out_dtype), eager)
    return out if out is not None else torch.ops.tile_ops.gemm_softmax(a, b, scale, out_dtype)


GEMM_SOFTMAX = spec.register(spec.OpSpec(
    name="gemm_softmax",
    schema="(Tensor a, Tensor b, Scalar scale=1.0, ScalarType? out_dtype=None) -> Tensor",
    reference=gemm_softmax_reference,
    fake=_gemm_softmax_fake,
    launch=_gemm_softmax_cuda_checked,
    signature=_signature,
    setup_context=_gemm_softmax_setup_context,
    backward=_gemm_softmax_backward,
    saved=lambda inputs, p: (p, inputs[1], inputs[0]),  # as the backward reads them
    jvp=_gemm_softmax_jvp,
    tangent=_gemm_softmax_tangent,
    vmap=_gemm_softmax_vmap,
    tuning=GemmSoftmaxTarget(),
    problem=_gemm_softmax_problem,
))

"""``torch.ops.tile_ops.gemm``: (batched) matrix multiply with an optional bias epilogue.

Schema::

    tile_ops::gemm(Tensor a, Tensor b, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor

Implementations:

* CUDA: validates, allocates the output and launches the gemm kernel
  (``tile_ops.kernels.gemm_launch``: fp16/bf16 inputs, fp32 accumulation, bias
  added in the epilogue; with a split-K config, two kernels: fp32 partials,
  then their sum + bias; on sm_90a an operand whose rows are not 16-byte
  multiples is first copied into padded rows that TMA can load).  Operands
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
  rows.  Forward mode: ``da @ b + a @ db + dbias``; vmap: one gemm over the
  mapped dim; DTensor: sharded along M, N or K.

Everything the library's generic parts need of it is its ``OpSpec``, ``GEMM``, at the end.
"""

from typing import Optional

import torch

from ..autotune import targets
from . import checks, fastpath, forward_ad, functorch, matmul, sharding, spec

OP = "tile_ops.gemm"

# the plan's buffers (fastpath.py): the signature's tensors, the output, the scratch buffers
A, B, BIAS, OUT, SCRATCH = range(5)


def _kernels():
    """``tile_ops.kernels.gemm_launch``, imported at the first CUDA launch: the CPU path imports no kernel (nor
    TVM)."""
    from ..kernels import gemm_launch

    return gemm_launch


# --------------------------------------------------------------------------- CPU reference and fake


def gemm_reference(a, b, bias=None, out_dtype=None):
    """Plain-torch reference: ``(a @ b + bias)`` computed in float32 (float64 for float64)."""
    _, _, _, _, _, odt = matmul.check_matmul_inputs(OP, a, b, bias, out_dtype)
    cdt = matmul.compute_dtype(a.dtype)
    acc = torch.matmul(a.to(cdt), b.to(cdt))
    if bias is not None:
        acc = acc + bias.to(cdt)
    return acc.to(odt).contiguous()


def _gemm_fake(a, b, bias=None, out_dtype=None):
    _, batch, M, K, N, odt = matmul.check_matmul_inputs(OP, a, b, bias, out_dtype)
    return a.new_empty(matmul.output_shape(batch, M, N), dtype=odt)


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


def _gemm_cuda_checked(a, b, bias=None, out_dtype=None):
    """Validate, lay out and launch; record the call's plan when the kernel reads the caller's tensors."""
    out, launch_args = prepare_gemm_launch(a, b, bias, out_dtype, kind="cuda")
    if launch_args is None:
        return out
    a3, b3, out3, bias3 = launch_args
    kernels = _kernels()
    with torch.cuda.device(a.device):  # the JIT compiles for the current device's arch
        kernel, a3, b3 = kernels.get_gemm_kernel(a3, b3, out3, bias3)
    launch = kernels.gemm_launcher(kernel, a.device)
    launch(a3.data_ptr(), b3.data_ptr(), out3.data_ptr(), 0 if bias3 is None else bias3.data_ptr())
    operands = (a3, b3, out3) if bias is None else (a3, b3, out3, bias3)
    callers = (a, b, out) if bias is None else (a, b, out, bias)
    if fastpath.launched_in_place(operands, callers):
        bias_buffer = None if bias is None else BIAS
        program = kernels.gemm_plan(kernel, a.device, A, B, OUT, bias_buffer, SCRATCH)
        fastpath.record(GEMM.plan_id, *_signature(a, b, bias, out_dtype), (out,), program)
        if getattr(kernels, "family_ranges", None):  # (the tests' CPU stand-ins have none)
            dims = kernel.dims if isinstance(kernel, kernels.Sized) else ()  # M at run time
            fastpath.record_row_family(
                GEMM.plan_id, _signature(a, b, bias, out_dtype), a, out, dims,
                lambda dims: kernels.gemm_plan(kernel, a.device, A, B, OUT, bias_buffer, SCRATCH, dims=dims),
                lambda fold: kernels.family_ranges(kernels.gemm_problem(a3, b3, out3, bias3)[0], fold, a.device))
    return out


def _gemm_problem(a, b, bias=None, out_dtype=None) -> list:
    """The kernel problem of a call (record.py): what the CUDA path launches for it, on either device."""
    _, launch_args = prepare_gemm_launch(a, b, bias, out_dtype, kind="cuda")
    return [] if launch_args is None else [_kernels().gemm_problem(*launch_args)[0]]


def _signature(a, b, bias=None, out_dtype=None):
    """(tensors, flags): what a call's plan is keyed on (the wrapper's fast path spells it out)."""
    return (a, b, bias), (out_dtype,)


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


# --------------------------------------------------------------------------- forward mode and vmap


def _gemm_tangent(ops, args, tangents, y):
    """The tangent of ``y = gemm(a, b, bias, out_dtype)``: ``ta @ b + a @ tb + tbias`` (None: no tangent)."""
    (a, b, _, out_dtype), (ta, tb, tbias, _) = args, tangents
    tangent = forward_ad.sum_terms([ops.gemm(ta, b, None, out_dtype) if ta is not None else None,
                                    ops.gemm(a, tb, None, out_dtype) if tb is not None else None,
                                    tbias.to(y.dtype) if tbias is not None else None])
    return tangent.expand_as(y).to(y.dtype)


def _gemm_jvp(ctx, ta, tb, tbias, _):
    b, a, y = ctx.saved_tensors
    return _gemm_tangent(spec.WRAPPERS, (a, b, None, y.dtype), (ta, tb, tbias, None), y)


def _gemm_vmap(info, in_dims, a, b, bias=None, out_dtype=None):
    """One gemm over the mapped dim; a mapped bias (one per slice: model ensembles) is added after a float32
    (float64) gemm, as the kernel adds it before rounding."""
    a_dim, b_dim, bias_dim = (*in_dims, None)[:3]  # (no entry for an omitted bias)
    matmul.check_matmul_inputs(OP, functorch.one_slice(a, a_dim), functorch.one_slice(b, b_dim),
                               functorch.one_slice(bias, bias_dim), out_dtype)
    if bias_dim is None:
        return functorch.batched_matmul(lambda x, y: GEMM.op(x, y, bias, out_dtype), a, b, a_dim, b_dim), 0
    out = functorch.batched_matmul(lambda x, y: GEMM.op(x, y, None, matmul.compute_dtype(a.dtype)),
                                   a, b, a_dim, b_dim)
    bias = functorch.mapped_first(bias, bias_dim)
    bias = bias.reshape(bias.shape[0], *[1] * (out.dim() - 2), bias.shape[-1])  # over its slice's rows
    return (out + bias).to(out_dtype or a.dtype), 0


# --------------------------------------------------------------------------- DTensor


def _gemm_sharding(a, b, bias=None, out_dtype=None):
    """``out = a @ b (+ bias)`` on one mesh dimension: all replicated; the rows of ``a`` sharded (M); the columns
    of ``b`` sharded (N, the bias with them); or the contraction dimension sharded (K), giving a Partial (summed)
    output and a Partial bias."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out_nd = max(a.ndim, b.ndim)

    def strategy(out, pa, pb, pbias):
        return [out], [pa, pb, pbias if bias is not None else None, None]

    return [
        strategy(Replicate(), Replicate(), Replicate(), Replicate()),
        strategy(Shard(out_nd - 2), Shard(a.ndim - 2), Replicate(), Replicate()),  # rows (M)
        strategy(Shard(out_nd - 1), Replicate(), Shard(b.ndim - 1), Shard(0)),  # columns (N)
        strategy(Partial(), Shard(a.ndim - 1), Shard(b.ndim - 2), Partial()),  # contraction (K)
    ]


# --------------------------------------------------------------------------- the autotuner and the CLI


class GemmTarget(targets.Target):
    demo = [((4096, 4096, 4096), "float16"), ((4096, 4096, 4096), "bfloat16"), ((1000, 1000, 1000), "float16"),
            ((1000, 1000, 1000), "bfloat16")]
    demo_quick = [((256, 256, 128), "float16"), ((256, 256, 128), "bfloat16")]
    precompile = [(4096, 4096, 4096), (8192, 8192, 8192), (1000, 1000, 1000)]  # bench_gemm.py's main shapes

    def configs(self):
        from ..kernels import gemm_config, gemm_defaults, gemm_space

        return targets.KernelConfigs(gemm_config.GemmConfig, gemm_space.config_space, gemm_defaults.default_config,
                                     gemm_config.shared_memory_bytes)

    def compile(self, shape, dtype: str, cfg, arch: str):
        M, N, K = shape
        # a split-K config builds two kernels (the gemm's partials, their reduction): one launchable
        return _kernels().build_gemm(M, N, K, 1, 1, 1, False, False, False, dtype, dtype, cfg, target=arch)

    def problem(self, shape, dtype: str, scale: float = 1.0) -> dict:
        M, N, K = shape
        return dict(M=M, N=N, K=K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
                    dtype=dtype, out_dtype=dtype, bias_dtype=None)

    def kernel_call(self, problem: dict, arch: str):
        from ..kernels.gemm import gemm as program

        kernels, p = _kernels(), problem
        cfg = kernels.launch_config(p["M"], p["N"], p["K"], p["dtype"], p["batch"], p["trans_A"], arch=arch)
        return (program, *kernels.gemm_call(**p, cfg=cfg, target=arch)), lambda: kernels.build_problem(p, cfg, arch=arch)

    def inputs(self, shape, dtype: str, device):
        M, N, K = shape
        dt = getattr(torch, dtype)
        a, b = matmul.random_operands(M, N, K, dt, device)
        bias = torch.zeros(N, dtype=dt, device=device)  # unused (has_bias=False) but a valid pointer
        return [a.unsqueeze(0), b.unsqueeze(0), bias, torch.empty(1, M, N, dtype=dt, device=device)]

    def reference(self, args, scale: float = 1.0, dtype=None):
        dtype = dtype or torch.float32
        return torch.matmul(args[0][0].to(dtype), args[1][0].to(dtype))

    def torch_equivalent(self, args, scale: float):
        return lambda: torch.matmul(args[0][0], args[1][0])

    def flops(self, shape) -> int:
        M, N, K = shape
        return 2 * M * N * K


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
    rank runs it on its shards (``_gemm_sharding``).

    Calls ``torch.ops.tile_ops.gemm``, except for a repeated CUDA call that
    the dispatcher would add nothing to (eager, no autograd graph, plain
    tensors): that one launches the kernel recorded for its signature directly.
    """
    eager = not torch.compiler.is_compiling()  # dynamo folds this to True and traces the op instead
    casting = checks.autocasting(a)
    if eager and not casting and not forward_ad.plain_operands_may_be_dual():
        out = fastpath.call(GEMM.plan_id, (a, b, bias), (out_dtype,), True)  # _signature, inline: 0.3 µs less
        if out is not None:
            return out
    checks.check_argument_types(OP, out_dtype, a=a, b=b, bias=bias)
    if casting:
        a, b, bias = checks.autocast(a, b, bias)
    if eager:
        sharding.register_if_in_use()
    else:  # run by dynamo while it traces, not put in the graph
        sharding.register_when_traced()
    out = spec.transformed(GEMM, gemm, (a, b, bias, out_dtype), eager)
    return out if out is not None else torch.ops.tile_ops.gemm(a, b, bias, out_dtype)


GEMM = spec.register(spec.OpSpec(
    name="gemm",
    schema="(Tensor a, Tensor b, Tensor? bias=None, ScalarType? out_dtype=None) -> Tensor",
    reference=gemm_reference,
    fake=_gemm_fake,
    launch=_gemm_cuda_checked,
    signature=_signature,
    setup_context=_gemm_setup_context,
    backward=_gemm_backward,
    saved=lambda inputs, y: (inputs[1], inputs[0], y),  # (b, a) as the backward reads them, then y
    jvp=_gemm_jvp,
    tangent=_gemm_tangent,
    vmap=_gemm_vmap,
    tuning=GemmTarget(),
    sharding=_gemm_sharding,
    problem=_gemm_problem,
))

"""The FlashAttention forward's torch side: the kernel a call launches and its launch over (B, H, S, D) views of
the op's (B, S, H, D) tensors (tile_ops/ops/attention.py)."""


import functools

import torch

from tile_ops.autotune import config_for
from tile_ops.compiler.meta import span
from tile_ops.jit import default_arch

from .attention import flash_attention_forward
from .attention_backward import attention_delta, flash_attention_backward, flash_attention_backward_dq
from .attention_config import backward_config, backward_dq_config, default_config, dq_kernel_of

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def attention_problem(q, causal=False, window=(-1, -1), softcap=0.0, alibi=False, varlen=False) -> dict:
    """The kernel's compile-time arguments for a call: the head dim, dtype and mask kind, and whether the
    sequences are packed (never a size, nor the scale, softcap or window sizes, which the kernel takes at
    launch)."""
    left, right = window
    return dict(dim=q.shape[-1], dtype=_DT[q.dtype], causal=bool(causal), local=left >= 0 or (right >= 0 and not causal),
                softcap=softcap > 0, alibi=bool(alibi), varlen=bool(varlen))


def build_attention(problem: dict, cfg=None, arch=None):
    """The kernel for ``problem`` (``attention_problem``'s) with ``cfg`` (default: the head dim's)."""
    arch = arch or default_arch()
    cfg = cfg or default_config(problem["dim"], arch)
    return flash_attention_forward(**problem, cfg=cfg, target=arch)


# the plan buffers of the forward's kernel parameters q, k, v, out, lse, slopes: the op's tensors (q, k, v,
# alibi_slopes), then its outputs
_PLAN_BUFFERS = (0, 1, 2, 4, 5, 3)


def launch_attention(q, k, v, out, lse, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                     alibi_slopes=None, arch=None):
    """out (B, Sq, Hq, D), lse (B, Hq, Sq) of the checked inputs, on the current stream; ``arch``: the path
    (default: the device's).  Batches whose tensors span 2^31 elements or more (the kernel's 32-bit offsets)
    run in parts along the batch.  Returns the launch as a plan program (``Kernel.plan``) over the plan buffers
    q, k, v, alibi_slopes, out, lse, or None where the call ran in parts or on a copy of the slopes."""
    problem = attention_problem(q, causal, window, softcap, alibi_slopes is not None)
    B, Sq, Hq, D = q.shape
    cfg = config_for("flash_attention", Sq, Hq, D, problem["dtype"], q.device, arch)
    kernel = build_attention(problem, cfg, arch=arch or default_arch(q.device))
    tensors = [q, k, v, out, lse]
    if alibi_slopes is not None:
        tensors.append(slopes_view(alibi_slopes, q.shape[0], q.shape[2]))
    scalars = _scalars(q.shape[-1], softmax_scale, softcap, window)
    parts = batch_parts(tensors)
    for b0, b1 in parts:
        # the op checked dtypes, shapes and alignment; the sizes and strides come from these very tensors
        values = _launch(kernel, [t[b0:b1].transpose(1, 2) for t in tensors[:4]] + [t[b0:b1] for t in tensors[4:]],
                         q.device, scalars)
    copied = alibi_slopes is not None and tensors[5].data_ptr() != alibi_slopes.data_ptr()
    if len(parts) > 1 or copied or kernel.meta.needs_workspace:
        return None
    return kernel.plan(q.device, _PLAN_BUFFERS[:len(tensors)], dims=values)


def launch_attention_varlen(q, k, v, out, lse, offsets_q, offsets_k, cu_seqlens_q, cu_seqlens_k, softmax_scale=None,
                            causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None, arch=None):
    """out (total_q, Hq, D), lse (Hq, total_q) of packed sequences (``offsets_q``/``offsets_k``: the host copies of
    the checked ``cu_seqlens_q``/``cu_seqlens_k``), in one launch over the query tiles that exist."""
    problem = attention_problem(q, causal, window, softcap, alibi_slopes is not None, varlen=True)
    arch = arch or default_arch(q.device)
    cfg = default_config(problem["dim"], arch)
    kernel = build_attention(problem, cfg, arch)
    tiles = _tile_table(tuple(offsets_q), tuple(offsets_k), cfg.block_M, bool(causal), q.device)
    if tiles is None:
        return
    k, v = k[:offsets_k[-1]], v[:offsets_k[-1]]  # rows of no sequence (say, uninitialized) then read as 0
    tensors = [t.unsqueeze(0).transpose(1, 2) for t in (q, k, v, out)] + [lse.unsqueeze(0)]
    if alibi_slopes is not None:
        tensors.append(slopes_view(alibi_slopes, len(offsets_q) - 1, q.shape[1]))
    tensors += [tiles, cu_seqlens_q, cu_seqlens_k]
    _launch(kernel, tensors, q.device, _scalars(q.shape[-1], softmax_scale, softcap, window))


@functools.lru_cache(maxsize=32)
def _tile_table(offsets_q: tuple, offsets_k: tuple, block_M: int, causal: bool, device):
    """``varlen_tiles`` on ``device`` (None: no tile), built once for the offsets every layer of a model shares."""
    tiles = varlen_tiles(offsets_q, offsets_k, block_M, causal)
    return torch.tensor(tiles, dtype=torch.int32).to(device) if tiles else None


def varlen_tiles(offsets_q, offsets_k, block_M: int, causal: bool) -> list:
    """[(sequence, query block)] of every query tile of the packed sequences: a sequence's tiles side by side (the
    blocks running together share its K/V in L2), the sequences with the most work first and, within one, the
    blocks that walk the most keys first (the last wave then holds the short ones)."""
    tiles = []
    for s, (q0, q1, k0, k1) in enumerate(zip(offsets_q, offsets_q[1:], offsets_k, offsets_k[1:])):
        sq, sk = q1 - q0, k1 - k0
        keys = [min(sk, max(0, (b + 1) * block_M + sk - sq)) if causal else sk for b in range(-(-sq // block_M))]
        tiles += [(-sum(keys), -n, s, b) for b, n in enumerate(keys)]
    tiles.sort()
    return [(s, b) for _, _, s, b in tiles]


def slopes_view(alibi_slopes, B, Hq):
    """The (B, Hq) view the kernels read ALiBi slopes through: a (Hq,) tensor over the batch with stride 0."""
    slopes = alibi_slopes if alibi_slopes.stride(-1) == 1 and alibi_slopes.data_ptr() % 16 == 0 else \
        alibi_slopes.clone()
    return slopes.expand(B, Hq)


def backward_kernels(problem: dict, cfg=None, arch=None, deterministic=False) -> list:
    """[(factory, arguments)] of the backward's kernels for ``problem`` (``attention_problem``'s): the key-block
    kernel with ``cfg`` (default: the head dim's), dQ by its atomic adds, or (``dq_kernel_of``) then the
    query-block dQ kernel.  What the launch builds and ``precompile`` fills the cache with."""
    arch = arch or default_arch()
    separate = dq_kernel_of(problem["dim"], deterministic)
    kernels = [(flash_attention_backward, dict(problem, atomic_dq=not separate,
                                               cfg=cfg or backward_config(problem["dim"], arch)))]
    if separate:
        kernels.append((flash_attention_backward_dq, dict(problem, cfg=backward_dq_config(problem["dim"], arch))))
    return kernels


def build_attention_backward(problem: dict, cfg=None, arch=None, deterministic=False):
    """(the key-block kernel, the dQ kernel or None): ``backward_kernels``' built."""
    arch = arch or default_arch()
    built = [fn(**args, target=arch) for fn, args in backward_kernels(problem, cfg, arch, deterministic)]
    return built[0], built[1] if len(built) > 1 else None


def launch_attention_backward(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=None, causal=False, window=(-1, -1),
                              softcap=0.0, alibi_slopes=None, grad_lse=None, deterministic=False, arch=None):
    """dq, dk, dv (B, S, H, D, written) of the checked forward inputs, its ``out`` and ``lse``, and the output's
    gradient ``dout`` (and the LSE's, ``grad_lse``, or None), on the current stream: Delta = rowsum(dout * out)
    (less grad_lse), then the key-block kernel (dK, dV), whose atomic adds into a zeroed float32 buffer give dQ,
    or (``dq_kernel_of``: ``deterministic``, or any head dim but 128) the query-block dQ kernel: no atomics, the
    same bits every run."""
    arch = arch or default_arch(q.device)
    problem = attention_problem(q, causal, window, softcap, alibi_slopes is not None)
    kernel, dq_kernel = build_attention_backward(problem, arch=arch, deterministic=deterministic)
    separate = dq_kernel is not None
    delta_kernel = attention_delta(q.shape[-1], _DT[q.dtype], target=arch)
    B, Sq, Hq, D = q.shape
    delta = torch.empty(B, Hq, Sq, dtype=torch.float32, device=q.device)
    dq_acc = None if separate else torch.zeros(B, Hq, Sq, D, dtype=torch.float32, device=q.device)
    tensors = [q, k, v, dout, out, lse, delta, dq if separate else dq_acc, dk, dv]
    if alibi_slopes is not None:
        tensors.append(slopes_view(alibi_slopes, B, Hq))
    scalars = _scalars(D, softmax_scale, softcap, window)
    for b0, b1 in batch_parts(tensors):
        part = [t[b0:b1] for t in tensors]
        q_, k_, v_, dout_, out_, lse_, delta_, dq_, dk_, dv_ = part[:10]
        _launch(delta_kernel, [out_.transpose(1, 2), dout_.transpose(1, 2), delta_], q.device, {})
        if grad_lse is not None:
            delta_.sub_(grad_lse[b0:b1].masked_fill(lse_.isinf(), 0.0))
        inputs = [t.transpose(1, 2) for t in (q_, k_, v_, dout_)] + [lse_, delta_]
        dkv = [t.transpose(1, 2) for t in (dk_, dv_)]
        _launch(kernel, inputs + ([] if separate else [dq_]) + dkv + part[10:], q.device, scalars)
        if separate:
            _launch(dq_kernel, inputs + [dq_.transpose(1, 2)] + part[10:], q.device, scalars)
    if not separate:
        dq.copy_(dq_acc.transpose(1, 2))


def launch_attention_backward_varlen(dout, q, k, v, out, lse, dq, dk, dv, offsets_q, offsets_k, cu_seqlens_q,
                                     cu_seqlens_k, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                                     alibi_slopes=None, grad_lse=None, deterministic=False, arch=None):
    """dq, dk, dv (total, H, D, written whole: 0 on rows of no sequence) of packed sequences, as
    ``launch_attention_backward`` computes them (Delta, the key-block kernel over every sequence's key blocks, dQ
    by its atomic adds or the query-block kernel over the query tiles), each in one launch."""
    arch = arch or default_arch(q.device)
    problem = attention_problem(q, causal, window, softcap, alibi_slopes is not None, varlen=True)
    (kernel, kernel_args), *dq_part = backward_kernels(problem, arch=arch, deterministic=deterministic)
    for t, end in ((dq, offsets_q[-1]), (dk, offsets_k[-1]), (dv, offsets_k[-1])):
        t[end:].zero_()
    # the kernels see the rows of the sequences only: others (say, uninitialized) then read as 0
    tq, tk = offsets_q[-1], offsets_k[-1]
    dout, q, out, dq = (t[:tq] for t in (dout, q, out, dq))
    k, v, dk, dv = (t[:tk] for t in (k, v, dk, dv))
    lse = lse[:, :tq] if tq == lse.shape[1] else lse[:, :tq].contiguous()
    _, Hq, D = q.shape
    packed = lambda t: t.unsqueeze(0).transpose(1, 2)  # noqa: E731  (total, H, D) as the kernels' (1, H, total, D)
    delta = torch.empty(1, Hq, tq, dtype=torch.float32, device=q.device)
    _launch(attention_delta(D, _DT[q.dtype], target=arch), [packed(out), packed(dout), delta], q.device, {})
    if grad_lse is not None:
        delta[0].sub_(grad_lse[:, :tq].masked_fill(lse.isinf(), 0.0))
    dq_acc = None if dq_part else torch.zeros(1, Hq, tq, D, dtype=torch.float32, device=q.device)
    inputs = [packed(t) for t in (q, k, v, dout)] + [lse.unsqueeze(0), delta]
    slopes = [] if alibi_slopes is None else [slopes_view(alibi_slopes, len(offsets_q) - 1, Hq)]
    scalars, offsets, device = _scalars(D, softmax_scale, softcap, window), [cu_seqlens_q, cu_seqlens_k], q.device
    key_tiles = _tile_table(tuple(offsets_k), tuple(offsets_q), kernel_args["cfg"].block_N, False, device)
    if key_tiles is not None:
        _launch(kernel(**kernel_args, target=arch), inputs + ([] if dq_part else [dq_acc]) +
                [packed(dk), packed(dv)] + slopes + [key_tiles] + offsets, device, scalars)
    if not dq_part:
        dq.copy_(dq_acc[0].transpose(0, 1))
        return
    fn, args = dq_part[0]
    query_tiles = _tile_table(tuple(offsets_q), tuple(offsets_k), args["cfg"].block_M, bool(causal), device)
    if query_tiles is not None:
        _launch(fn(**args, target=arch), inputs + [packed(dq)] + slopes + [query_tiles] + offsets, device, scalars)


class ShapedLaunch:
    """A kernel bound to one layout, as the autotuner and the demo launch it: ``launch_ptrs(pointers, device)``
    with the pointers of ``tensors`` (the kernel's parameters as views, meta tensors will do) in the order
    ``order`` gives (parameter i takes pointer ``order[i]``), its sizes, strides and ``scalars`` read once."""

    def __init__(self, kernel, tensors, order, scalars):
        self.kernel, self.order = kernel, order
        self.values = kernel.values(kernel.dims.read(tensors), **scalars)

    def launch_ptrs(self, ptrs, device):
        self.kernel.launch_ptrs([ptrs[i] for i in self.order], device, self.values)

    def __getattr__(self, name):  # meta, instruction_mix(), ...: the kernel's
        return getattr(self.kernel, name)


def forward_launch(kernel, batch: int, seqlen: int, heads: int, dim: int, dtype) -> ShapedLaunch:
    """``kernel`` (the forward) over contiguous (B, S, H, D) q, k, v, an (B, H, S) lse and an out like q, its
    pointers in that order (out last: the tuner's convention), plain attention at the default scale."""
    q = torch.empty(batch, seqlen, heads, dim, dtype=dtype, device="meta")
    lse = torch.empty(batch, heads, seqlen, device="meta")
    views = [q.transpose(1, 2)] * 4 + [lse]
    return ShapedLaunch(kernel, views, (0, 1, 2, 4, 3), _scalars(dim, None, 0.0, (-1, -1)))


def training_kernels(problem: dict, arch: str) -> list:
    """The kernels a training step launches for ``problem``, built: the forward (default config), Delta and the
    backward's (``backward_kernels``)."""
    built = [build_attention(problem, arch=arch), attention_delta(problem["dim"], problem["dtype"], target=arch)]
    return built + [fn(**args, target=arch) for fn, args in backward_kernels(problem, arch=arch)]


def _scalars(dim, softmax_scale, softcap, window) -> dict:
    """The kernels' launch-time scalars: the scale (1/sqrt(dim) by default), the softcap, the window's bounds."""
    scale = dim ** -0.5 if softmax_scale is None else softmax_scale
    return dict(scale=float(scale), softcap=float(softcap), window_left=int(window[0]), window_right=int(window[1]))


def _launch(kernel, args, device, scalars) -> tuple:
    """Launch ``kernel`` on ``args``; returns its launch values (sizes, strides and scalars)."""
    values = kernel.values(kernel.dims.read(args), **scalars)
    kernel.launch_ptrs([t.data_ptr() for t in args], device, values)
    return values


def batch_parts(tensors, limit: int = 2**31) -> list:
    """[(b0, b1)]: the fewest runs of batch entries over which every tensor (batch first) spans fewer than
    ``limit`` elements; ValueError where one entry alone does."""
    B = tensors[0].shape[0]
    one = max(span(t.shape[1:], t.stride()[1:]) for t in tensors)
    if one >= limit:
        raise ValueError(f"tile_ops.flash_attention: one batch entry spans {one:,} elements of a tensor, which "
                         f"the kernel addresses with 32-bit offsets (accepted: below 2^31 per entry); split the "
                         f"heads or the sequence into calls below that")
    step = max(abs(t.stride(0)) for t in tensors)
    n = B if step == 0 else max(1, min(B, (limit - one - 1) // step + 1))  # (n - 1) * step + one < limit
    return [(b, min(b + n, B)) for b in range(0, B, n)]

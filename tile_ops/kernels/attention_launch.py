"""The FlashAttention forward's torch side: the kernel a call launches and its launch over (B, H, S, D) views of
the op's (B, S, H, D) tensors (tile_ops/ops/attention.py)."""


import torch

from tile_ops.jit import default_arch

from .attention import flash_attention_forward
from .attention_config import default_config

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def attention_problem(q, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0, alibi=False) -> dict:
    """The kernel's compile-time arguments for a call: what one kernel is built per (never a size)."""
    dim = q.shape[-1]
    scale = None if softmax_scale is None or softmax_scale == dim ** -0.5 else float(softmax_scale)
    left, right = window
    return dict(dim=dim, dtype=_DT[q.dtype], causal=bool(causal), window=(int(left), 0 if causal else int(right)),
                softcap=float(softcap), alibi=bool(alibi), scale=scale)


def build_attention(problem: dict, cfg=None, arch=None):
    """The kernel for ``problem`` (``attention_problem``'s) with ``cfg`` (default: the head dim's)."""
    arch = arch or default_arch()
    cfg = cfg or default_config(problem["dim"], arch)
    return flash_attention_forward(**problem, cfg=cfg, target=arch)


def launch_attention(q, k, v, out, lse, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                     alibi_slopes=None):
    """out (B, Sq, Hq, D), lse (B, Hq, Sq) of the checked inputs, on the current stream."""
    problem = attention_problem(q, softmax_scale, causal, window, softcap, alibi_slopes is not None)
    kernel = build_attention(problem, arch=default_arch(q.device))
    args = [t.transpose(1, 2) for t in (q, k, v, out)] + [lse]
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.stride(-1) == 1 and alibi_slopes.data_ptr() % 16 == 0 else \
            alibi_slopes.clone()
        args.append(slopes.expand(q.shape[0], q.shape[2]))  # (Hq,) over the batch: its stride 0
    # the op checked dtypes, shapes and alignment; the sizes and strides come from these very tensors
    kernel.launch_ptrs([t.data_ptr() for t in args], q.device, kernel.dims.read(args))

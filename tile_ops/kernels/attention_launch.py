"""The FlashAttention forward's torch side: the kernel a call launches and its launch over (B, H, S, D) views of
the op's (B, S, H, D) tensors (tile_ops/ops/attention.py)."""


import torch

from tile_ops.jit import default_arch

from .attention import flash_attention_forward
from .attention_config import default_config

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def attention_problem(q, causal=False, window=(-1, -1), softcap=0.0, alibi=False) -> dict:
    """The kernel's compile-time arguments for a call: the head dim, dtype and mask kind (never a size, nor the
    scale, softcap or window sizes, which the kernel takes at launch)."""
    left, right = window
    return dict(dim=q.shape[-1], dtype=_DT[q.dtype], causal=bool(causal), local=left >= 0 or (right >= 0 and not causal),
                softcap=softcap > 0, alibi=bool(alibi))


def build_attention(problem: dict, cfg=None, arch=None):
    """The kernel for ``problem`` (``attention_problem``'s) with ``cfg`` (default: the head dim's)."""
    arch = arch or default_arch()
    cfg = cfg or default_config(problem["dim"], arch)
    return flash_attention_forward(**problem, cfg=cfg, target=arch)


def launch_attention(q, k, v, out, lse, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0,
                     alibi_slopes=None, arch=None):
    """out (B, Sq, Hq, D), lse (B, Hq, Sq) of the checked inputs, on the current stream; ``arch``: the path
    (default: the device's)."""
    kernel = build_attention(attention_problem(q, causal, window, softcap, alibi_slopes is not None),
                             arch=arch or default_arch(q.device))
    args = [t.transpose(1, 2) for t in (q, k, v, out)] + [lse]
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.stride(-1) == 1 and alibi_slopes.data_ptr() % 16 == 0 else \
            alibi_slopes.clone()
        args.append(slopes.expand(q.shape[0], q.shape[2]))  # (Hq,) over the batch: its stride 0
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    # the op checked dtypes, shapes and alignment; the sizes and strides come from these very tensors
    values = kernel.values(kernel.dims.read(args), scale=float(scale), softcap=float(softcap),
                           window_left=int(window[0]), window_right=int(window[1]))
    kernel.launch_ptrs([t.data_ptr() for t in args], q.device, values)

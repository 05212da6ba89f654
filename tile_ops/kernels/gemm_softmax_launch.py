"""The fused gemm + softmax's torch side: the kernel an op call launches (its config, its scale), its launch
and its plan (tile_ops/ops/gemm_softmax.py)."""


import math
import warnings
from dataclasses import replace

from tile_ops.autotune import config_for
from tile_ops.lang import SharedMemoryError

from .gemm_launch import _DT, launch_plan
from .gemm_softmax import gemm_softmax
from .gemm_softmax_config import _output_tile_fits, _widest_split, shared_memory_bytes

_SCALES_SEEN: dict = {}  # the problem (shape, dtypes) -> the scales compiled for it in this process
MANY_SCALES = 8


def get_gemm_softmax_kernel(a, b, out, scale=1.0, cfg=None):
    """The kernel computing out (M, N) = softmax(scale * a (M, K) @ b (K, N), -1)."""
    M, K = a.shape
    N = b.shape[1]
    if cfg is None:
        cfg = config_for("gemm_softmax", M, N, K, _DT[a.dtype], a.device)
        if cfg.deferred and not _output_tile_fits(shared_memory_bytes(cfg, M, N, K, _DT[a.dtype]), cfg,
                                                  _DT[a.dtype], _DT[out.dtype]):  # a float32 output
            cfg = replace(cfg, deferred=False)  # first: _widest_split tries splits, which a deferred config refuses
            cfg = replace(cfg, split=_widest_split(N, cfg))
    _note_scale((M, N, K, a.dtype, out.dtype), float(scale))
    try:
        return gemm_softmax(M, N, K, float(scale), _DT[a.dtype], _DT[out.dtype], cfg)
    except SharedMemoryError as e:  # the kernel's line and "reduce block sizes": nothing an op caller can change
        raise ValueError(f"tile_ops.gemm_softmax: rows of N = {N} scores are too wide for its kernel on {e.arch}: "
                         f"the per-row state it keeps on chip grows with N ({e.needed} bytes of shared memory "
                         f"needed, {e.limit} available); accepted: narrower rows; for these, compute "
                         f"torch.softmax(scale * tile_ops.gemm(a, b), -1)") from e


def _note_scale(problem, scale: float) -> None:
    """The scale is a constant of the compiled kernel (folded into its exp2 multiplier): a scale that changes
    every call (a learnable temperature) compiles a kernel, and stores one on disk, every call. Say so once."""
    seen = _SCALES_SEEN.setdefault(problem, set())
    seen.add(scale)
    if len(seen) == MANY_SCALES:
        warnings.warn(f"tile_ops.gemm_softmax: {MANY_SCALES} different scales for one problem {problem[:3]}; each "
                      f"compiles (and caches) its own kernel, the scale being a constant of it. For a scale that "
                      f"changes every step, pass scale=1.0 and multiply a (or b) by it instead", stacklevel=3)


def gemm_softmax_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr)`` for a kernel from ``get_gemm_softmax_kernel``."""

    run = kernel.launcher(device)

    def launch(a_ptr, b_ptr, out_ptr):
        run([a_ptr, b_ptr, out_ptr])

    return launch


def gemm_softmax_plan(kernel, device, a, b, out):
    """``gemm_softmax_launcher``'s launch as a plan program (``launch_plan``) over plan buffer indices."""
    return launch_plan(kernel, device, [a, b, out])


def launch_gemm_softmax(a, b, out, scale=1.0, cfg=None):
    """a (M, K), b (K, N) row-major; out (M, N) contiguous = softmax(scale * a @ b, -1)."""
    if not math.isfinite(scale):
        raise ValueError(f"tile_ops.gemm_softmax: scale must be finite, got {scale}")
    a, b = a.contiguous(), b.contiguous()
    kernel = get_gemm_softmax_kernel(a, b, out, scale, cfg)
    gemm_softmax_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr())
    return out

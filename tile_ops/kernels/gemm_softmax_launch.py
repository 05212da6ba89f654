"""The fused gemm + softmax's torch side: the kernel an op call launches (its config, its scale), its launch
and its plan (tile_ops/ops/gemm_softmax.py)."""


import math
import warnings
from dataclasses import replace

from tile_ops.autotune import config_for
from tile_ops.jit.kernel import Sized
from tile_ops.lang import SharedMemoryError

from .gemm_launch import _DT, launch_plan, token_runs
from .gemm_softmax import gemm_softmax
from .gemm_softmax_config import _output_tile_fits, _widest_split, one_wave_of_rows, shared_memory_bytes

_SCALES_SEEN: dict = {}  # the problem (shape, dtypes) -> the scales compiled for it in this process
MANY_SCALES = 8


def get_gemm_softmax_kernel(a, b, out, scale=1.0, cfg=None):
    """The kernel computing out (M, N) = softmax(scale * a (M, K) @ b (K, N), -1): one per config for every M
    (``Sized``, M bound)."""
    problem = softmax_problem(a, b, out, scale)
    _note_scale((problem["N"], problem["K"], a.dtype, out.dtype), problem["scale"])
    return build_problem(problem, cfg, a.device)


def softmax_problem(a, b, out, scale=1.0) -> dict:
    """``build_gemm_softmax``'s arguments for these operands (as ``TILE_OPS_RECORD`` writes them)."""
    (M, K), N = a.shape, b.shape[1]
    return dict(M=M, N=N, K=K, scale=float(scale), dtype=_DT[a.dtype], out_dtype=_DT[out.dtype])


def problem_args(problem: dict) -> tuple:
    """(M, N, K, scale, dtype, out_dtype) of a ``softmax_problem``."""
    return tuple(problem[k] for k in ("M", "N", "K", "scale", "dtype", "out_dtype"))


def problem_config(problem: dict, device=None, arch=None):
    """The config the op launches for ``problem``: ``config_for``'s, without the deferred store where a float32
    output tile does not fit beside it."""
    M, N, K, _, dtype, out_dtype = problem_args(problem)
    cfg = config_for("gemm_softmax", M, N, K, dtype, device, arch)
    if cfg.deferred and not _output_tile_fits(shared_memory_bytes(cfg, M, N, K, dtype), cfg, dtype, out_dtype):
        cfg = replace(cfg, deferred=False)  # first: _widest_split tries splits, which a deferred config refuses
        cfg = replace(cfg, split=_widest_split(N, cfg))
    return cfg


def build_problem(problem: dict, cfg=None, device=None, arch=None):
    """What the op launches for ``problem`` (``softmax_problem``'s): its config's ``build_gemm_softmax``."""
    M, N, K, scale, dtype, out_dtype = problem_args(problem)
    cfg = cfg or problem_config(problem, device, arch)
    try:
        return build_gemm_softmax(M, N, K, scale, dtype, out_dtype, cfg, target=arch)
    except SharedMemoryError as e:  # the kernel's line and "reduce block sizes": nothing an op caller can change
        raise ValueError(f"tile_ops.gemm_softmax: rows of N = {N} scores are too wide for its kernel on {e.arch}: "
                         f"the per-row state it keeps on chip grows with N ({e.needed} bytes of shared memory "
                         f"needed, {e.limit} available); accepted: narrower rows; for these, compute "
                         f"torch.softmax(scale * tile_ops.gemm(a, b), -1)") from e


def gemm_softmax_call(M, N, K, scale, dtype, out_dtype, cfg) -> tuple:
    """(args, kwargs) of the kernel ``build_gemm_softmax`` builds: M at run time."""
    return (None, N, K, scale, dtype, out_dtype, cfg), dict(one_wave=one_wave_of_rows(cfg, M))


def build_gemm_softmax(M, N, K, scale=1.0, dtype="float16", out_dtype="float16", cfg=None, target=None):
    """The launchable fused kernel for this problem: one kernel per config for every M (``Sized``, M bound)."""
    args, kwargs = gemm_softmax_call(M, N, K, scale, dtype, out_dtype, cfg)
    return Sized(gemm_softmax(*args, **kwargs, target=target), (M,))


def _note_scale(problem, scale: float) -> None:
    """The scale is a constant of the compiled kernel (folded into its exp2 multiplier): a scale that changes
    every call (a learnable temperature) compiles a kernel, and stores one on disk, every call. Say so once."""
    seen = _SCALES_SEEN.setdefault(problem, set())
    seen.add(scale)
    if len(seen) == MANY_SCALES:
        warnings.warn(f"tile_ops.gemm_softmax: {MANY_SCALES} different scales for one problem (N, K) = {problem[:2]}; each "
                      f"compiles (and caches) its own kernel, the scale being a constant of it. For a scale that "
                      f"changes every step, pass scale=1.0 and multiply a (or b) by it instead", stacklevel=3)


def gemm_softmax_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr)`` for a kernel from ``get_gemm_softmax_kernel``."""

    run = kernel.launcher(device)

    def launch(a_ptr, b_ptr, out_ptr):
        run([a_ptr, b_ptr, out_ptr])

    return launch


def gemm_softmax_plan(kernel, device, a, b, out, dims=()):
    """``gemm_softmax_launcher``'s launch as a plan program (``launch_plan``) over plan buffer indices; ``dims``:
    M as a PlanExpr, for a plan family."""
    return launch_plan(kernel, device, [a, b, out], dims=dims)


def launch_identity(problem: dict, device=None, arch=None) -> tuple:
    """What ``build_problem`` launches for ``problem``, without building it (``gemm_launch.launch_identity``)."""
    M, N, K, scale, dtype, out_dtype = problem_args(problem)
    return gemm_softmax_call(M, N, K, scale, dtype, out_dtype, problem_config(problem, device, arch))


def family_ranges(problem: dict, fold: int, device=None, arch=None, reach: int = 1024) -> list:
    """``gemm_launch.family_ranges`` for the fused kernel."""
    return token_runs(problem, fold, lambda p: launch_identity(p, device, arch), reach)


def launch_gemm_softmax(a, b, out, scale=1.0, cfg=None):
    """a (M, K), b (K, N) row-major; out (M, N) contiguous = softmax(scale * a @ b, -1)."""
    if not math.isfinite(scale):
        raise ValueError(f"tile_ops.gemm_softmax: scale must be finite, got {scale}")
    a, b = a.contiguous(), b.contiguous()
    kernel = get_gemm_softmax_kernel(a, b, out, scale, cfg)
    gemm_softmax_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr())
    return out

"""The gemm's torch side: ``build_gemm`` (the gemm kernel, with its split-K reduction and operand padding where
needed), the config a launch takes, and the launches and plans of the ops (tile_ops/ops/gemm.py)."""


import dataclasses

import torch

from tile_ops.autotune import config_for
from tile_ops.autotune.table import shape_bucket
from tile_ops.compiler.meta import evaluate
from tile_ops.jit import default_arch
from tile_ops.jit.kernel import Sized

from .gemm import _check_problem, gemm, gemm_splitk_reduce, pad_rows, reduce_tile
from .gemm_config import _ESIZE, GemmConfig, _epilogue_overlaid, _misfit
from .gemm_defaults import default_config

_DT = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def _storage(x):
    """(view, transposed?, batch count): the kernel reads dense (batch, rows, cols) storage, so a 3-D view
    whose last two dims are row-major or a plain transpose is passed as is; anything else is copied."""
    batched = x.shape[0] > 1 and x.stride(0) != 0
    for trans in (False, True):
        s = x.transpose(-1, -2) if trans else x
        rows, cols = s.shape[-2:]
        if (s.stride(-1) == 1 or cols == 1) and (s.stride(-2) == cols or rows == 1) and (
                not batched or s.stride(0) == rows * cols):
            return x, trans, (x.shape[0] if batched else 1)
    return x.contiguous(), False, x.shape[0]


def _prepare(a, b):
    a, ta, ba = _storage(a)
    b, tb, bb = _storage(b)
    return a, b, ta, ba, tb, bb


class _ComposedGemm:
    """Several kernels launched like one gemm kernel: ``launch_ptrs([A, B, Bias, C], device)``, ``launcher``
    or ``plan``.  The main one's meta and its ``DESCRIBED_BY_MAIN`` attributes stand for the whole (what the
    tuner and tests report); nothing else is forwarded, so a launch method of the main kernel alone
    (``launch``, ``grid_on``, ...) is an AttributeError, not a partial launch.  Workspaces are
    caching-allocator ``torch.empty`` per launch on the current stream, which every kernel runs on (so
    freeing them right after is stream-ordered)."""

    main_attr = ""
    DESCRIBED_BY_MAIN = ("source", "cubin", "tir", "sass", "instruction_mix")

    def __getattr__(self, name):
        if name in self.DESCRIBED_BY_MAIN:
            return getattr(getattr(self, self.main_attr), name)
        raise AttributeError(f"{type(self).__name__} has no {name!r}: it launches several kernels as one "
                             f"(launch_ptrs, launcher, plan); its main kernel describes it only through "
                             f"meta, {', '.join(self.DESCRIBED_BY_MAIN)}")

    def launcher(self, device):
        return lambda ptrs, dims=(): self.launch_ptrs(ptrs, device, dims)


class SplitKGemm(_ComposedGemm):
    """A split-K gemm: the partial kernel (``gemm`` with ``cfg.split_k > 1``), the reduction kernel and the
    fp32 workspace W (split_k, batch, M, N) between them."""

    main_attr = "partial"

    def __init__(self, partial, reduce):
        self.partial, self.reduce = partial, reduce.dependent()  # launched while the partials are summed up
        self.meta = partial.meta  # the main kernel's (grid, smem, arch, ...): what the tuner reports

    def dependent(self) -> "SplitKGemm":
        """Both kernels launched programmatically (``Kernel.dependent``): the gemm after ``PaddedGemm``'s pads."""
        return SplitKGemm(self.partial.dependent(), self.reduce)

    def __repr__(self) -> str:
        return f"<tile_ops SplitKGemm {self.partial!r} + {self.reduce!r}>"

    def workspace_shape(self, dims=()) -> tuple:
        """The partials' (split_k, batch, M, N) at the T.dynamic sizes ``dims`` (M's)."""
        return _output(self.partial, dims)[0]

    def plan(self, device, buffers, scratch, dims=()):
        """Both kernels as a plan program (``Kernel.plan``), the workspace as scratch buffer ``scratch``."""
        a, b, bias, c = buffers
        _, partial = self.partial.plan(device, [a, b, bias, scratch], dims=dims)
        _, reduce = self.reduce.plan(device, [scratch, bias, c], dims=dims)
        return [(self.workspace_shape(dims), torch.float32)], partial + reduce

    def launch_ptrs(self, ptrs, device, dims=()):
        a_ptr, b_ptr, bias_ptr, c_ptr = ptrs
        w = torch.empty(self.workspace_shape(dims), dtype=torch.float32, device=device)
        self.partial.launch_ptrs([a_ptr, b_ptr, bias_ptr, w.data_ptr()], device, dims)
        self.reduce.launch_ptrs([w.data_ptr(), bias_ptr, c_ptr], device, dims)


class PaddedGemm(_ComposedGemm):
    """A gemm whose A or B rows are not 16-byte multiples, which TMA cannot load: ``pad_rows`` first copies
    each such operand into a workspace of padded rows, and the gemm (``a_cols``/``b_cols``) reads those.
    Padding along K (A's rows, or B^T's) meets the other operand's zeros past K (TMA fills them, or its own
    zero padding); padding along M (A^T's) or N (B's) makes output rows or columns that are never stored.
    ``pads``: {operand index (0: A, 1: B): its pad kernel, whose output Y is the workspace}."""

    main_attr = "main"

    def __init__(self, pads, main):
        # every step after the first launched programmatically (Kernel.dependent): it starts while the one
        # before runs and waits for it at its entry
        first = next(iter(pads))
        self.pads = {i: pad if i == first else pad.dependent() for i, pad in pads.items()}
        self.main = main.dependent()
        self.meta = main.meta

    def dependent(self) -> "PaddedGemm":
        """Every step launched programmatically, the first pad too (``Kernel.dependent``)."""
        return PaddedGemm({i: pad.dependent() for i, pad in self.pads.items()}, self.main)

    def __repr__(self) -> str:
        return f"<tile_ops PaddedGemm {list(self.pads.values())!r} + {self.main!r}>"

    def plan(self, device, buffers, scratch, dims=()):
        """The pads and the gemm as one plan program, each padded operand a scratch buffer from ``scratch``
        on (a gemm whose launch runs host code, stream-K, is planned whole by ``launch_plan``)."""
        padded, spaces, steps = list(buffers), [], []
        for i, pad in self.pads.items():
            spaces.append(_output(pad, dims))
            steps += pad.plan(device, [buffers[i], scratch + len(spaces) - 1], dims=dims)[1]
            padded[i] = scratch + len(spaces) - 1
        scratch_main, steps_main = self.main.plan(device, padded, scratch + len(spaces), dims=dims)
        return spaces + scratch_main, steps + steps_main

    def launch_ptrs(self, ptrs, device, dims=()):
        ptrs, workspaces = list(ptrs), []
        for i, pad in self.pads.items():
            shape, dtype = _output(pad, dims)
            workspaces.append(torch.empty(shape, dtype=dtype, device=device))
            pad.launch_ptrs([ptrs[i], workspaces[-1].data_ptr()], device, dims)
            ptrs[i] = workspaces[-1].data_ptr()
        self.main.launch_ptrs(ptrs, device, dims)


def _output(kernel, dims) -> tuple:
    """(shape, torch dtype) of a kernel's last parameter (a pad's padded operand, split-K's partials) at the
    T.dynamic sizes ``dims``."""
    _, shape, dtype = kernel.meta.params[-1]
    named = dict(zip((name for name, _ in kernel.meta.dims), dims))
    return tuple(evaluate(d, named) for d in shape), getattr(torch, dtype)


def _stored(M, N, K, batch_a, batch_b, trans_A, trans_B) -> list:
    """The stored (batch, rows, cols) of A and B."""
    return [(batch_a, *((K, M) if trans_A else (M, K))), (batch_b, *((N, K) if trans_B else (K, N)))]


def padded_cols(M, N, K, batch_a=1, batch_b=1, trans_A=False, trans_B=False, dtype="float16", target=None) -> dict:
    """``gemm``'s ``a_cols``/``b_cols`` as ``build_gemm`` gives them: for each operand whose stored rows TMA
    cannot load (sm_90a; not 16-byte multiples), the 16-byte multiple it is padded to.  {} when none."""
    if (target or default_arch()) != "sm_90a":
        return {}
    esize = _ESIZE[dtype]
    return {name: -(-cols * esize // 16) * 16 // esize
            for name, (_, _, cols) in zip(("a_cols", "b_cols"), _stored(M, N, K, batch_a, batch_b, trans_A, trans_B))
            if cols * esize % 16}


def build_gemm(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
               dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig(), target=None, pad=True,
               bias_dtype=None, static_m=False):
    """The launchable gemm for ``cfg``: the ``gemm`` kernel itself, a :class:`SplitKGemm` when
    ``cfg.split_k > 1``, inside a :class:`PaddedGemm` when TMA (sm_90a) cannot load A's or B's rows as
    they are (``pad=False``: the gemm's synchronous-copy path reads them).  Each takes
    ``launch_ptrs([A, B, Bias, C], device)``; Bias in ``bias_dtype`` (the input dtype unless given).

    Its kernels take M at run time (one per config for every M: ``Sized``, M bound) unless ``static_m`` or A
    is stored M-contiguous with rows TMA cannot load (M not a multiple of 8 on sm_90a: padded per M)."""
    _check_problem(M, N, K, batch, batch_a, batch_b, dtype, out_dtype, bias_dtype or dtype)
    args, kwargs = gemm_call(M, N, K, batch, batch_a, batch_b, trans_A, trans_B, has_bias, dtype, out_dtype, cfg,
                             target, pad, bias_dtype, static_m)
    bias_dtype = kwargs["bias_dtype"]  # None where it is the input dtype: one cache entry whichever way it is said
    cols = {k: v for k, v in kwargs.items() if k.endswith("_cols")}
    m = args[0]
    dynamic = m is None
    main = gemm(*args, **kwargs, target=target)
    if cfg.split_k > 1:
        reduce = gemm_splitk_reduce(m, N, batch, cfg.split_k, has_bias, dtype, out_dtype, *reduce_tile(M, N),
                                    bias_dtype=bias_dtype, target=target)
        main = SplitKGemm(main, reduce)
    if cols:
        stored = _stored(M, N, K, batch_a, batch_b, trans_A, trans_B)
        if dynamic:  # A's rows (K): their count is M
            stored[0] = (stored[0][0], None, stored[0][2])
        main = PaddedGemm({i: pad_rows(*stored[i], n, dtype, target=target)
                           for i, name in enumerate(("a_cols", "b_cols")) if (n := cols.get(name))}, main)
    return Sized(main, (M,)) if dynamic else main


def gemm_call(M, N, K, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=False, has_bias=False,
              dtype="float16", out_dtype="float16", cfg: GemmConfig = GemmConfig(), target=None, pad=True,
              bias_dtype=None, static_m=False) -> tuple:
    """(args, kwargs) of the ``gemm`` kernel ``build_gemm`` builds for this problem (without ``target``): M at
    run time (None) unless ``static_m`` or A is stored M-contiguous in rows TMA cannot load."""
    bias_dtype = None if bias_dtype == dtype else bias_dtype  # one cache entry whichever way it is said
    cols = padded_cols(M, N, K, batch_a, batch_b, trans_A, trans_B, dtype, target) if pad else {}
    dynamic = not static_m and not (trans_A and "a_cols" in cols)
    shape = dict(one_wave=_epilogue_overlaid(cfg, M, N, batch), m_multiple=_m_multiple(M, trans_A)) if dynamic else {}
    args = (None if dynamic else M, N, K, batch, batch_a, batch_b, trans_A, trans_B, has_bias, dtype, out_dtype, cfg)
    return args, dict(cols, bias_dtype=bias_dtype, **shape)


def _m_multiple(M: int, trans_A: bool) -> int:
    """A runtime-M kernel's ``m_multiple``: where A is stored M-contiguous, 8 for an M that is a multiple of 8
    (16-byte rows: TMA, vector loads), else 1 (its own kernel, rows read element by element on sm_80)."""
    return 8 if trans_A and M % 8 == 0 else 1


def get_gemm_kernel(a, b, out, bias=None, cfg=None):
    """(kernel, a, b): the kernel for these operands and the operand views it reads.

    ``config_for`` chooses per (M, N, K). A tuned config that cannot build here (its clusters do not divide
    this M's tiles: it was tuned for another M of the bucket; or A is stored another way) gives way to the
    default. The heuristic default, fitted to the waves of one matrix, is re-derived with the batch; a tuned
    split-K config (``split_k > 1``) is divided by the batch count (a batch already multiplies the CTAs).
    An explicit ``cfg`` is used as is."""
    problem, a, b = gemm_problem(a, b, out, bias)
    return build_problem(problem, cfg=cfg, device=a.device), a, b


def gemm_problem(a, b, out, bias=None) -> tuple:
    """(problem, a, b): ``build_gemm``'s arguments for these operands (a dict of ints, bools and dtype names, as
    ``TILE_OPS_RECORD`` writes it) and the operand views the kernel reads."""
    Bt, M, K = a.shape
    N = b.shape[-1]
    a, b, ta, ba, tb, bb = _prepare(a, b)
    problem = dict(M=M, N=N, K=K, batch=Bt, batch_a=ba, batch_b=bb, trans_A=ta, trans_B=tb,
                   has_bias=bias is not None, dtype=_DT[a.dtype], out_dtype=_DT[out.dtype],
                   bias_dtype=None if bias is None or bias.dtype == a.dtype else _DT[bias.dtype])
    return problem, a, b


def build_problem(problem: dict, cfg=None, device=None, arch=None):
    """What the op launches for ``problem`` (``gemm_problem``'s): its config's ``build_gemm``."""
    p = problem
    cfg = cfg or launch_config(p["M"], p["N"], p["K"], p["dtype"], p["batch"], p["trans_A"], device, arch)
    return build_gemm(**p, cfg=cfg, target=arch)


def launch_config(M, N, K, dtype, batch=1, trans_A=False, device=None, arch=None) -> GemmConfig:
    """The config the op launches (and ``precompile`` builds) for this problem: see ``get_gemm_kernel``."""
    cfg = config_for("gemm", M, N, K, dtype, device, arch)
    if _misfit(cfg, M, N, trans_A):  # tuned for another M of the bucket, or another layout of A
        cfg = default_config(M, N, K, arch, trans_A=trans_A)
    if batch > 1 and cfg == default_config(M, N, K, arch, trans_A=trans_A):  # the heuristic fits one matrix's
        cfg = default_config(M, N, K, arch, batch=batch, trans_A=trans_A)  # waves: the batch's
    elif batch > 1 and cfg.split_k > 1:  # a tuned split: the batch already multiplies the CTAs
        cfg = dataclasses.replace(cfg, split_k=max(1, cfg.split_k // batch))
    return cfg


def gemm_launcher(kernel, device):
    """``launch(a_ptr, b_ptr, out_ptr, bias_ptr=0)`` for a kernel from ``get_gemm_kernel`` (0: no bias);
    a split-K gemm launches both its kernels (and allocates their workspace) per call."""

    run = kernel.launcher(device)

    def launch(a_ptr, b_ptr, out_ptr, bias_ptr=0):
        run(_gemm_params(a_ptr, b_ptr, out_ptr, bias_ptr or None))

    return launch


def gemm_plan(kernel, device, a, b, out, bias=None, scratch=None, dims=()):
    """``gemm_launcher``'s launch as a plan program (``launch_plan``) over plan buffer indices a, b, out and
    bias (None: no bias); workspaces (a split-K gemm's partials, a PaddedGemm's padded operands) are the
    buffers from ``scratch`` on.  ``dims``: M as a PlanExpr, for a plan family."""
    return launch_plan(kernel, device, _gemm_params(a, b, out, bias), scratch, dims)


def launch_identity(problem: dict, device=None, arch=None) -> tuple:
    """What ``build_problem`` launches for ``problem``, without building it: equal at two M exactly when the op
    launches the same kernels there (the M range of a plan family)."""
    p = problem
    cfg = launch_config(p["M"], p["N"], p["K"], p["dtype"], p["batch"], p["trans_A"], device, arch)
    args, kwargs = gemm_call(**p, cfg=cfg, target=arch)
    return args, tuple(sorted(kwargs.items())), reduce_tile(p["M"], p["N"]) if cfg.split_k > 1 else None


def family_ranges(problem: dict, fold: int, device=None, arch=None, reach: int = 1024) -> list:
    """[(lo, hi)]: the runs of token counts m near the problem's (its M being ``fold`` * m) at which the op
    launches what it launches at the problem's M (``token_runs``)."""
    return token_runs(problem, fold, lambda p: launch_identity(p, device, arch), reach)


def token_runs(problem: dict, fold: int, identity, reach: int = 1024) -> list:
    """[(lo, hi)]: the runs of m, at most ``reach`` either way of the problem's (M = ``fold`` * m) and within M's
    autotune bucket (the tuner's table changes its config per bucket), whose problem has the same
    ``identity(problem)`` as the problem's and operands under 2^31 elements (the kernels' 32-bit offsets)."""
    m0, top = problem["M"] // fold, shape_bucket(problem["M"])
    widest = max(problem["K"], problem["N"]) * problem.get("batch", 1) * fold
    lo, hi = max(-(-(top // 2 + 1) // fold), m0 - reach), min(top // fold, (2 ** 31 - 1) // widest, m0 + reach)
    want, runs = identity(problem), []
    for m in range(lo, hi + 1):
        if identity({**problem, "M": fold * m}) != want:
            continue
        if runs and runs[-1][1] == m - 1:
            runs[-1][1] = m
        else:
            runs.append([m, m])
    return [tuple(r) for r in runs]


def launch_plan(kernel, device, buffers, scratch=None, dims=()):
    """``kernel.plan(device, buffers, scratch)``: the launch as a plan program for the ops' fast path
    (ops/fastpath.py), ``buffers[i]`` the plan buffer of the kernel's parameter i.  A launch keeping a workspace
    per stream (stream-K), which a recorded plan cannot hold, is planned as host code instead: a callable
    ``launch(*pointers)`` taking the pointers of all the plan's buffers, in order."""
    if kernel.meta.needs_workspace:
        run = kernel.launcher(device)
        return lambda *pointers: run([pointers[i] for i in buffers])
    return kernel.plan(device, buffers, scratch, dims)


def _gemm_params(a, b, out, bias):
    """The gemm kernel's parameters [A, B, Bias, C] (pointers or plan buffers); without a bias its unused
    slot takes the output's: any valid pointer."""
    return [a, b, out if bias is None else bias, out]


def launch_gemm(a, b, out, bias=None, cfg=None):
    """a (Bt, M, K), b (Bt, K, N): row-major or plain-transposed views (batch stride 0 = broadcast);
    out (Bt, M, N) contiguous; bias (N,) or None."""
    kernel, a, b = get_gemm_kernel(a, b, out, bias, cfg)
    bias_ptr = 0 if bias is None else bias.data_ptr()
    gemm_launcher(kernel, a.device)(a.data_ptr(), b.data_ptr(), out.data_ptr(), bias_ptr)
    return out

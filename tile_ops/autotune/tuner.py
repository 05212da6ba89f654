"""Tune one (op, shape, dtype): declared space -> pruned -> compiled in parallel -> checked and timed
on the GPU -> best persisted in the table."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import sys
import time

from ..compiler.targets import smem_limit as arch_smem_limit
from . import table, targets
from .progress import progress


@dataclasses.dataclass
class Candidate:
    config: object
    ms: float | None = None  # median time of one launch
    skipped: str | None = None  # why it was not timed: "shared memory: ...", "compile error: ...", ...
    compile_s: float | None = None
    kernel: object = dataclasses.field(default=None, repr=False)


@dataclasses.dataclass
class TuneResult:
    op: str
    shape: tuple
    dtype: str
    arch: str
    gpu: str | None
    default: object  # the heuristic default config (always among the candidates)
    candidates: list
    key: str | None = None  # the table entry written, if any

    @property
    def best(self) -> Candidate | None:
        timed = [c for c in self.candidates if c.ms is not None]
        return min(timed, key=lambda c: c.ms) if timed else None

    @property
    def default_ms(self) -> float | None:
        return next((c.ms for c in self.candidates if c.config == self.default), None)


def smem_limit(arch: str, device=None) -> int:
    """Dynamic shared memory a block may use: the GPU's opt-in limit, else the arch's."""
    if device is not None:
        import torch

        limit = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
        if limit:
            return limit
    return arch_smem_limit(arch)


def make_candidates(target, shape, dtype: str, arch: str, configs=None) -> list[Candidate]:
    """The declared space (or ``configs``) plus the default, without duplicates, in order."""
    configs = list(configs if configs is not None else target.config_space(shape, dtype, arch))
    configs.append(target.default_config(shape, arch))
    return [Candidate(c) for c in dict.fromkeys(configs)]


def prune(target, candidates, shape, dtype: str, limit: int) -> None:
    """Skip the candidates whose shared-memory estimate is over ``limit`` (no compile wasted on them)."""
    for c in candidates:
        need = target.shared_memory_bytes(c.config, shape, dtype)
        if need > limit:
            c.skipped = f"shared memory: needs ~{need} B, the limit is {limit} B"


def compile_all(target, candidates, shape, dtype: str, arch: str, limit: int, workers=None, show=True) -> None:
    """Build the candidates not yet skipped in a thread pool: nvcc runs as a subprocess, so builds overlap
    (tracing and lowering hold the GIL, but are the smaller part).  Failures are recorded, not raised."""
    todo = [c for c in candidates if c.skipped is None]

    def build(c: Candidate) -> None:
        t0 = time.perf_counter()
        try:
            c.kernel = target.compile(shape, dtype, c.config, arch)
        except Exception as e:  # noqa: BLE001 - any failure disqualifies the candidate, with its reason
            c.skipped = f"compile error: {type(e).__name__}: {e}"
            return
        finally:
            c.compile_s = time.perf_counter() - t0
        if c.kernel.meta.smem_bytes > limit:
            c.skipped = f"shared memory: uses {c.kernel.meta.smem_bytes} B, the limit is {limit} B"

    with progress(len(todo), "compile", show) as bar, cf.ThreadPoolExecutor(workers or os.cpu_count()) as pool:
        for future in cf.as_completed([pool.submit(build, c) for c in todo]):
            future.result()
            bar.update()


def measure_all(candidates, measure, show=True) -> None:
    """Time the compiled candidates one at a time with ``measure(kernel, config) -> ms``."""
    from .bench import DeviceLost, WrongResult

    todo = [c for c in candidates if c.skipped is None]
    best = None
    with progress(len(todo), "time", show) as bar:
        for c in todo:
            try:
                c.ms = float(measure(c.kernel, c.config))
            except WrongResult as e:
                c.skipped = f"wrong result: {e}"
            except DeviceLost:
                raise
            except Exception as e:  # noqa: BLE001 - launch errors and the like disqualify, with the reason
                c.skipped = f"launch error: {type(e).__name__}: {e}"
            else:
                best = c.ms if best is None else min(best, c.ms)
            bar.set_postfix_str(f"best {best:.4f} ms" if best is not None else "")
            bar.update()


def tune(op: str, shape, dtype: str = "float16", *, configs=None, arch: str | None = None, device=None,
         measure=None, gpu: str | None = None, compile_only: bool = False, save: bool = True,
         workers: int | None = None, show_progress: bool = True) -> TuneResult:
    """Find the fastest config of ``op`` for ``shape`` (M, N, K) and ``dtype``.

    ``configs`` replaces the kernel's declared ``config_space``; the heuristic default is always tried.
    ``measure(kernel, config) -> ms`` replaces the GPU measurement (:class:`~.bench.GpuBench`), and
    ``gpu`` names the GPU the result is filed under (default: ``device``'s).  ``compile_only`` builds
    the candidates (into the kernel cache) without timing them: no GPU needed.  With ``save`` the best
    config is written to the table, where :func:`tile_ops.autotune.config_for` finds it.
    """
    from ..jit import default_arch

    target = targets.get(op)
    shape = tuple(int(x) for x in shape)
    on_gpu = not compile_only and measure is None
    if on_gpu:
        device = _cuda_device(device)
    arch = arch or default_arch(device if on_gpu else None)  # the GPU it times on, not the current one
    gpu = gpu or (table.gpu_name(device) if on_gpu else None)
    if save and not compile_only and gpu is None:
        raise ValueError("tile_ops.autotune.tune: no GPU name to file the result under; pass gpu=...")
    limit = smem_limit(arch, device if on_gpu else None)
    candidates = make_candidates(target, shape, dtype, arch, configs)
    result = TuneResult(op, shape, dtype, arch, gpu, target.default_config(shape, arch), candidates)
    prune(target, candidates, shape, dtype, limit)
    compile_all(target, candidates, shape, dtype, arch, limit, workers, show_progress)
    if compile_only:
        return result
    if on_gpu:
        from .bench import GpuBench

        measure = GpuBench(target, shape, dtype, device)
    measure_all(candidates, measure, show_progress)
    best = result.best
    if save and best is not None:
        try:
            result.key = table.record(op, shape, dtype, gpu, best.config, ms=best.ms, default_ms=result.default_ms,
                                      arch=arch, candidates=len(candidates),
                                      skipped=sum(c.skipped is not None for c in candidates))
        except (OSError, RuntimeError) as e:  # an unwritable cache, another version's table: keep what was found
            print(f"tile_ops.autotune: best of {op} {'x'.join(map(str, shape))} {dtype} on {gpu} ({arch}): "
                  f"{best.config}, {best.ms:.4f} ms (the default: {result.default_ms} ms)", file=sys.stderr)
            raise table.TableWriteError(f"tile_ops: {str(e).removeprefix('tile_ops: ')}; the best config, printed "
                                        f"above, was not recorded (pass it as cfg=..., or tune again)") from e
    return result


def _cuda_device(device):
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("tile_ops.autotune: timing candidates needs a CUDA GPU and none is available; "
                           "compile_only=True builds them without timing (or pass measure=...)")
    device = torch.device(device if device is not None else "cuda")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

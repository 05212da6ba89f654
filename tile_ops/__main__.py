"""The ``tile_ops`` command line (``python -m tile_ops ...`` or the ``tile_ops`` console script).

    tile_ops demo [--arch ARCH] [--quick]     compile the library's kernels, show registers / smem / SASS mix;
                                             with a GPU also check them against torch and time both
    tile_ops cache info | clear               the on-disk kernel cache ($TILE_OPS_CACHE_DIR or ~/.tile_ops/cache)
    tile_ops precompile --arch sm_90a [--gemm MxNxK ...] [--gemm-softmax MxNxK ...] [--flash-attention SxHxD ...]
                        [--dtype ...] [--record FILE ...] [--module FILE.py:FN ...] [--all-m MAX]
                                             fill the cache ahead of time (no GPU needed): an option per op, the
                                             problems a run recorded (TILE_OPS_RECORD), or a model's forward
    tile_ops tune OP --shape MxNxK [...] | --list | --show | --clear
                                             autotune kernel configs (tile_ops/autotune/cli.py)

Every command iterates over the registered ops (their ``OpSpec.tuning``, a ``tile_ops.autotune.targets.Target``:
the shapes each builds, how, and how to check and time it).  Kernels compile in parallel threads (tracing and
lowering hold the GIL; nvcc runs as a subprocess).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import math
import os
import sys
import time

from .autotune import cli as tune_cli
from .cli_common import parse_arch, parse_jobs, parse_scale, parse_shape, print_table

INTERESTING_OPS = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "UTMALDG", "SHFL", "BAR")
# the scale the demo compiles into the kernels that take one (benchmarks/bench_gemm_softmax.py's)
DEMO_SCALE = 0.125
PRECOMPILE_SCALES = [1.0, 0.125]  # the ops' default scale and the benchmark's
TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2}


# ---------------------------------------------------------------------------------------------- jobs
@dataclasses.dataclass
class Job:
    """One library kernel specialization: the op, its problem, and the target arch."""

    op: str
    shape: tuple | None  # the target's three sizes (None: a recorded problem whose kernels serve every size)
    dtype: str
    arch: str
    scale: float = 1.0  # the ops whose kernel takes one (Target.scaled)
    recorded: dict | None = None  # a problem from a recording (layouts, batch, bias...), else a plain call's
    whole: bool = True  # build what precompile builds (a backward's kernels too), not only what one call launches

    @property
    def target(self):
        from .autotune import targets

        return targets.get(self.op)

    @property
    def problem(self) -> dict:
        return self.recorded or self.target.problem(self.shape, self.dtype, self.scale)

    @property
    def label(self) -> str:
        if self.recorded:
            return f"{self.op} {self.target.describe(self.recorded)}"
        s = f"{self.op} {'x'.join(map(str, self.shape))} {self.dtype}"
        return s + (f" scale={self.scale:g}" if self.target.scaled else "")

    def key_and_builder(self):
        """(cache key of the main kernel the torch op path builds, a callable that builds what it launches:
        for a gemm, with its operand pads and split-K reduction; with ``whole``, what precompile builds)."""
        if self.whole:
            return self.target.precompiled(self.problem, self.arch)
        return self.target.launched(self.problem, self.arch)

    @staticmethod
    def of(entry: dict, arch: str) -> "Job":
        """The job of a recorded ``{"op", "problem"}`` entry (record.py)."""
        from .autotune import targets

        p = entry["problem"]
        return Job(entry["op"], targets.get(entry["op"]).shape_of(p), p["dtype"], arch, p.get("scale", 1.0),
                   recorded=p)


@dataclasses.dataclass
class Built:
    job: Job
    key: str = ""
    kernel: object = None
    seconds: float = 0.0
    cached: bool = False
    error: str | None = None  # first line, for the table
    detail: str | None = None  # the whole message
    not_stored: str | None = None  # why a kernel built here is not in the cache afterwards


def build(job: Job) -> Built:
    """Compile (or load from the disk cache) one job; never raises: errors are recorded."""
    from .jit import compiled_keys
    from .jit.cache import DiskCache, not_stored

    out = Built(job)
    try:
        out.key, make = job.key_and_builder()
        t0 = time.perf_counter()
        with compiled_keys() as compiled:
            out.kernel = make()
        out.seconds = time.perf_counter() - t0
        # built: compiled here (a corrupt entry is rebuilt); cached: loaded, also where another process built it
        # while this one waited for its lock (a check before make() counted those as built)
        out.cached = out.key not in compiled
        if not out.cached and DiskCache().load(out.key) is None:  # a full disk, a read-only cache: store() warned
            out.not_stored = not_stored.get(out.key, "it does not load back from the cache")
    except Exception as e:  # noqa: BLE001 - reported in the table
        msg = str(e).strip()
        out.error = f"{type(e).__name__}: {msg.splitlines()[0] if msg else ''}"
        out.detail = f"{type(e).__name__}: {msg}"
    return out


def _print_errors(built) -> None:
    for b in built:
        if b.detail:
            print(f"\n{b.job.label} ({b.job.arch}) failed:\n{b.detail}", file=sys.stderr)


def _parallel_note(built) -> str:
    if len(built) < 2:
        return ""
    return " (parallel threads)"


def build_all(jobs, workers=None):
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    with cf.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(build, jobs))


def instruction_mix(kernel) -> dict | None:
    """Counts of INTERESTING_OPS in the kernel's SASS, or None when cuobjdump is unavailable/fails."""
    try:
        mix = kernel.instruction_mix()
    except Exception:  # noqa: BLE001 - no cuobjdump (or it failed): the demo prints n/a
        return None
    return {op: mix.get(op, 0) for op in INTERESTING_OPS}


def _gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# ---------------------------------------------------------------------------------------------- demo
def _bench_ms(fn) -> float:
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    import torch

    for _ in range(5):
        fn()
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def _run_on_gpu(b: Built, device="cuda") -> dict:
    """Fresh random inputs, float64 reference, relative Frobenius error, then ours vs torch timing."""
    import torch

    job, target = b.job, b.job.target
    args = target.inputs(job.shape, job.dtype, torch.device(device))
    out = args[-1].fill_(float("nan"))  # poisoned
    ptrs, kernel = [t.data_ptr() for t in args], target.launchable(b.kernel, job.shape, job.dtype)
    ours = lambda: kernel.launch_ptrs(ptrs, out.device)  # noqa: E731
    theirs = target.torch_equivalent(args, job.scale)
    ref = target.reference(args, job.scale, torch.float64)
    ours()
    torch.cuda.synchronize()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    ok = math.isfinite(err) and err < TOLERANCE.get(job.dtype, 1e-2)
    t_ours, t_torch = _bench_ms(ours), _bench_ms(theirs)
    if target.speed == "TFLOP/s":
        tf = lambda ms: target.flops(job.shape) / ms / 1e9  # noqa: E731
        perf = {"ours": f"{tf(t_ours):.1f} TFLOP/s", "torch": f"{tf(t_torch):.1f} TFLOP/s"}
    else:
        perf = {"ours": f"{t_ours * 1e3:.1f} us", "torch": f"{t_torch * 1e3:.1f} us"}
    return {"rel_err": f"{err:.1e}", "check": "PASS" if ok else "FAIL", **perf,
            "speedup": f"{t_torch / t_ours:.2f}x"}


def cmd_demo(args) -> int:
    from .jit import default_arch
    from .jit.cache import cache_dir

    gpu = _gpu_available()
    arch = args.arch or default_arch()
    if not gpu:
        print(f"No CUDA GPU found: compiling for {arch} only (no launches, no correctness check or timing).")
    else:
        import torch

        print(f"GPU: {torch.cuda.get_device_name()} (local arch {default_arch()}); compiling for {arch}.")
    print(f"Kernel cache: {cache_dir()}  (entries at <cache>/<key[:2]>/<key>/)")
    from .autotune import targets

    jobs = [Job(op, shape, dt, arch, DEMO_SCALE, whole=False) for op, target in targets.TARGETS.items()
            for shape, dt in (target.demo_quick if args.quick else target.demo)]
    t0 = time.perf_counter()
    built = build_all(jobs)
    print(f"Built or loaded {len(jobs)} kernels in {time.perf_counter() - t0:.1f} s{_parallel_note(built)}.\n")

    with cf.ThreadPoolExecutor(max(1, len(built))) as pool:  # cuobjdump runs are independent
        mixes = list(pool.map(lambda b: instruction_mix(b.kernel) if b.kernel is not None else None, built))
    rows, failed = [], False
    for b, mix in zip(built, mixes):
        j = b.job
        row = {"kernel": j.op, "shape": "x".join(map(str, j.shape)), "dtype": j.dtype, "arch": j.arch,
               "key": b.key[:12]}
        if b.error:
            failed = True
            row["compile"] = "ERROR"
            row["note"] = b.error[:100]
            rows.append(row)
            continue
        res, m = b.kernel.meta.resources, b.kernel.meta
        row["compile"] = f"cached ({b.seconds:.2f}s)" if b.cached else f"{b.seconds:.1f}s"
        row["regs"] = res.get("registers", "?")
        row["spills"] = res.get("spill_stores", 0) + res.get("spill_loads", 0) if res else "?"
        row["smem_bytes"] = m.smem_bytes
        for op in INTERESTING_OPS:
            row[op] = mix[op] if mix is not None else "n/a"
        if gpu:
            try:
                row.update(_run_on_gpu(b))
            except Exception as e:  # noqa: BLE001 - e.g. a cubin for another arch than the GPU's
                row["check"] = "ERROR"
                row["note"] = f"{type(e).__name__}: {e}"[:100]
            failed = failed or row.get("check") != "PASS"
        rows.append(row)
    columns = ["kernel", "shape", "dtype", "arch", "compile", "regs", "spills", "smem_bytes", *INTERESTING_OPS]
    if gpu:
        columns += ["rel_err", "check", "ours", "torch", "speedup"]
    columns += ["key"]
    if any("note" in r for r in rows):
        columns.append("note")
    print_table(rows, columns)
    _print_errors(built)
    if all(m is None for m in mixes) and any(b.kernel is not None for b in built):
        print("\n(SASS instruction mix n/a: cuobjdump not found; pip install nvidia-cuda-cuobjdump "
              "or set TILE_OPS_CUOBJDUMP)")
    return 1 if failed else 0


# --------------------------------------------------------------------------------------------- cache
def cmd_cache(args) -> int:
    from .jit.cache import DiskCache

    cache = DiskCache()
    if args.action == "info":
        info = cache.info()
        print(f"path:    {info['path']}")
        print(f"entries: {info['entries']}")
        print(f"size:    {info['bytes'] / 1e6:.2f} MB")
        return 0
    removed, left = cache.clear()
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.root}")
    if left:  # a read-only cache, another user's entries
        print(f"error: could not remove {len(left)} entr{'y' if len(left) == 1 else 'ies'}: {', '.join(left[:3])}"
              + (", ..." if len(left) > 3 else ""), file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------- precompile
def cmd_precompile(args) -> int:
    from .autotune import targets
    from .jit.cache import cache_dir

    asked = {op: getattr(args, op) for op in targets.TARGETS}
    recorded = recorded_jobs(args)
    if all(shapes is None for shapes in asked.values()) and not recorded:
        asked = {op: target.precompile for op, target in targets.TARGETS.items()}
    jobs = [job for op, target in targets.TARGETS.items() for s in asked[op] or [] for dt in args.dtype
            for sc in (args.scale if target.scaled else [1.0]) for job in _shape_jobs(op, s, dt, args.arch, sc)]
    jobs = _distinct(jobs + recorded)
    if args.all_m:
        jobs = _distinct([j for job in jobs for j in every_m(job, args.all_m)])
    print(f"Precompiling {len(jobs)} kernel{'s' if len(jobs) != 1 else ''} for {args.arch} into {cache_dir()} ({args.jobs or 'auto'} threads)")
    t0 = time.perf_counter()
    built = build_all(jobs, args.jobs)
    rows = []
    for b in built:
        status = "ERROR" if b.error else "cached" if b.cached else "built, NOT stored" if b.not_stored else "built"
        rows.append({"kernel": b.job.label, "key": b.key, "status": status, "seconds": f"{b.seconds:.2f}",
                     "note": b.error or b.not_stored or ""})
    print_table(rows, ["kernel", "key", "status", "seconds", "note"])
    _print_errors(built)
    n_err = sum(1 for b in built if b.error)
    n_unstored = sum(1 for b in built if b.not_stored)
    n_new = sum(1 for b in built if not b.error and not b.cached) - n_unstored
    print(f"{n_new} built, {len(built) - n_new - n_unstored - n_err} already cached, {n_err} failed"
          + (f", {n_unstored} built but NOT stored in the cache" if n_unstored else "")
          + f" in {time.perf_counter() - t0:.1f} s{_parallel_note(built)}")
    return 1 if n_err or n_unstored else 0


def _shape_jobs(op: str, shape, dtype: str, arch: str, scale: float) -> list:
    """The jobs of one shape asked for: its plain call's, or one per problem the op's target builds for it."""
    from .autotune import targets

    problems = targets.get(op).problems(shape, dtype, scale)
    if len(problems) == 1:
        return [Job(op, shape, dtype, arch, scale)]
    return [Job(op, shape, dtype, arch, scale, recorded=p) for p in problems]


def _distinct(jobs) -> list:
    """``jobs`` without repeats (a repeat would count as built twice)."""
    return list({json.dumps(dataclasses.asdict(j), sort_keys=True, default=str): j for j in jobs}.values())


def recorded_jobs(args) -> list:
    """The jobs of ``--record`` files and of ``--module`` runs (their op calls recorded on the CPU)."""
    from .ops import record

    entries = [e for path in args.record or [] for e in record.read(path)]
    for spec in args.module or []:
        entries += module_problems(spec)
    return [Job.of(e, args.arch) for e in entries]


def module_problems(spec: str) -> list:
    """The problems a model's forward launches: ``FILE.py:FN``, FN() returning (module, example inputs), run on
    the CPU (or wherever its inputs are) under ``record.recording()``."""
    import importlib.util

    import torch

    from .ops import record

    path, _, name = spec.rpartition(":")
    if not path or not name or not os.path.isfile(path):
        raise SystemExit(f"tile_ops precompile: --module {spec!r}; accepted: FILE.py:FUNCTION, FUNCTION() returning "
                         f"(an nn.Module, a tuple of example inputs)")
    mod_spec = importlib.util.spec_from_file_location(f"tile_ops_precompile_{len(path)}", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    model, inputs = getattr(module, name)()
    with torch.no_grad(), record.recording() as problems:
        model(*(inputs if isinstance(inputs, (tuple, list)) else (inputs,)))
    return problems


def every_m(job: Job, most: int) -> list:
    """``job`` at every M in 1..``most`` that the op launches another kernel for (its config, or a variant of
    one, changes with M): a deployment's every token count, one job per kernel."""
    if job.target.shape_of(job.problem) is None:  # its kernels serve every size
        return [job]
    seen, jobs = set(), []
    for M in range(1, most + 1):
        problem = dict(job.problem, M=M)
        (_, args, kwargs), _ = job.target.kernel_call(problem, job.arch)
        call = repr((args, sorted(kwargs.items())))  # the kernel's key, without hashing it for every M
        if call not in seen:
            seen.add(call)
            jobs.append(dataclasses.replace(job, shape=(M, *job.shape[1:]), recorded=problem))
    return jobs


# ---------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    from .autotune import targets

    p = argparse.ArgumentParser(prog="tile_ops", description="tile_ops: tile-level GPU kernels on TVM TIRx")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    d = sub.add_parser("demo", help="compile the library's kernels; with a GPU check and time them vs torch")
    d.add_argument("--arch", type=parse_arch,
                   help="target arch, e.g. sm_90a or sm_80 (default: the local GPU's, else sm_90a)")
    d.add_argument("--quick", action="store_true", help="small shapes only (fast; for tests)")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("cache", help="inspect or clear the on-disk kernel cache")
    c.add_argument("action", choices=["info", "clear"])
    c.set_defaults(func=cmd_cache)

    pc = sub.add_parser("precompile", help="fill the kernel cache for given shapes (no GPU needed)")
    pc.add_argument("--arch", required=True, type=parse_arch, help="target arch, e.g. sm_90a or sm_80")
    for op, target in targets.TARGETS.items():
        pc.add_argument(f"--{op.replace('_', '-')}", dest=op, nargs="+", type=parse_shape, metavar=target.metavar,
                        help=f"{op} shapes (default, when no op's shapes are given: "
                        + (" ".join("x".join(map(str, s)) for s in target.precompile) or "none") + ")")
    pc.add_argument("--dtype", nargs="+", default=["float16", "bfloat16"], choices=["float16", "bfloat16"])
    pc.add_argument("--scale", nargs="+", type=parse_scale, default=PRECOMPILE_SCALES,
                    help=f"scales of {', '.join(op for op, t in targets.TARGETS.items() if t.scaled)} "
                    "(compile-time constants; default: 1.0 = the op's default, 0.125 = the benchmark's)")
    pc.add_argument("--record", nargs="+", metavar="FILE", help="kernel problems a run wrote with "
                    "TILE_OPS_RECORD=FILE (layouts, batches and biases as the ops met them)")
    pc.add_argument("--module", nargs="+", metavar="FILE.py:FN", help="a model: FN() returns (nn.Module, example "
                    "inputs); its forward runs on the CPU and the kernels its op calls launch on a GPU are built")
    pc.add_argument("--all-m", type=int, metavar="MAX", help="for every problem, the kernels of every M in 1..MAX "
                    "(a deployment's every token count), not only the M given or recorded")
    pc.add_argument("--jobs", "-j", type=parse_jobs, default=None, help="compile threads (default: one per kernel, "
                    "up to the CPU count)")
    pc.set_defaults(func=cmd_precompile)

    tune_cli.add_parser(sub)
    return p


def main(argv=None) -> int:
    from .jit.cache import CacheDirError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except CacheDirError as e:  # a setting to correct, not a crash: no traceback
        print(f"error: {str(e).removeprefix('tile_ops: ')}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Compile time, cold and warm, for the library's kernels.

    python benchmarks/compile_time.py [--arch sm_90a] [--json out.json]

For gemm 4096^3 fp16 and gemm_softmax 8192x2048x1024 fp16 (default configs), each with its own
empty temporary TILE_OPS_CACHE_DIR:

  cold  a fresh Python process imports the compiler (TVM; timed apart, a user's first compile pays it
        too), then calls the factory on the empty cache: trace + lower + nvcc + cache store.
        trace_s / lower_s (codegen_s of it: TVM's passes and CUDA generator) / nvcc_s / check_s (the SASS read
        for accumulator order) come from the cache
        entry's meta; "other" is the rest (the key, the cache store).
  warm  another fresh process with the same cache dir imports tile_ops, calls the factory (a disk
        hit) and, with a GPU, launches the kernel once and synchronizes.  Reported: process start
        to first launch done (without a GPU: to kernel ready), the factory call alone, and whether
        TVM was imported (it must not be).

Without a GPU the default arch is sm_90a (compile only).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

KERNELS = {  # name -> (op, (M, N, K), dtype)
    "gemm": ("gemm", (4096, 4096, 4096), "float16"),
    "gemm_softmax": ("gemm_softmax", (8192, 2048, 1024), "float16"),
}
SOFTMAX_SCALE = 0.125  # as in bench_gemm_softmax.py


# ------------------------------------------------------------------------------------ child process
def _factory(op, shape, dtype, arch):
    """(factory, args, kwargs) of the kernel the op launches at this shape (its M a runtime size)."""
    M, N, K = shape
    if op == "gemm":
        from tile_ops.kernels.gemm import gemm
        from tile_ops.kernels.gemm_defaults import default_config
        from tile_ops.kernels.gemm_launch import gemm_call

        return (gemm, *gemm_call(M, N, K, 1, 1, 1, False, False, False, dtype, dtype, default_config(M, N, K),
                                 target=arch))
    from tile_ops.kernels.gemm_softmax import gemm_softmax
    from tile_ops.kernels.gemm_softmax_defaults import default_config
    from tile_ops.kernels.gemm_softmax_launch import gemm_softmax_call

    return (gemm_softmax, *gemm_softmax_call(M, N, K, SOFTMAX_SCALE, dtype, dtype, default_config(M, N, K)))


def _launch_once(op, shape, dtype, kernel):
    import torch

    M, N, K = shape
    dt = getattr(torch, dtype)
    a = torch.randn(M, K, dtype=dt, device="cuda")
    b = torch.randn(K, N, dtype=dt, device="cuda")
    out = torch.empty(M, N, dtype=dt, device="cuda")
    ptrs = [a.data_ptr(), b.data_ptr(), out.data_ptr()]
    kernel.launch_ptrs(ptrs[:3] + ptrs[2:] if op == "gemm" else ptrs, a.device, (M,))  # gemm: A, B, bias, C
    torch.cuda.synchronize()


def child(mode, name, arch):
    """Runs in a fresh interpreter; prints one JSON line.  Times are time.monotonic() (system-wide)."""
    t_start = time.monotonic()
    import tile_ops  # noqa: F401

    t_import = time.monotonic()
    op, shape, dtype = KERNELS[name]
    arch = arch or __import__("tile_ops.jit", fromlist=["default_arch"]).default_arch()
    fn, args, kwargs = _factory(op, shape, dtype, arch)
    key = fn.key(args, kwargs, arch)
    tvm_import = None
    if mode == "cold":  # import the compiler (and TVM) first, so the factory call times the compile alone
        t0 = time.monotonic()
        import tile_ops.compiler.lower  # noqa: F401

        tvm_import = time.monotonic() - t0
    t0 = time.monotonic()
    kernel = fn(*args, **kwargs, target=arch)
    t_factory = time.monotonic()
    res = {"key": key, "import_s": t_import - t_start, "tvm_import_s": tvm_import, "factory_s": t_factory - t0,
           "tvm_before_launch": "tvm" in sys.modules}
    launched = False
    if mode == "warm":
        import torch

        from tile_ops.jit.launcher import get_launcher

        t0 = time.monotonic()
        res["launcher"] = get_launcher().__name__  # tile_ops._C, or tile_ops_C when JIT-built here
        res["launcher_s"] = time.monotonic() - t0
        if torch.cuda.is_available():
            t0 = time.monotonic()
            _launch_once(op, shape, dtype, kernel)
            res["launch_s"] = time.monotonic() - t0  # CUDA context, inputs, module load, launch, sync
            launched = True
    res.update(t_ready=time.monotonic(), launched=launched, tvm_imported="tvm" in sys.modules)
    if mode == "cold":
        from tile_ops.jit.cache import DiskCache

        entry = DiskCache().load(key)
        meta = entry.meta if entry is not None else {}
        res.update(trace_s=meta.get("trace_s"), lower_s=meta.get("lower_s"), codegen_s=meta.get("codegen_s"),
                   nvcc_s=meta.get("nvcc_s"),
                   check_s=meta.get("check_s"),
                   nvcc=meta.get("nvcc"),
                   registers=kernel.meta.resources.get("registers"))
    print("RESULT " + json.dumps(res))


# ----------------------------------------------------------------------------------------- driver
def run_child(mode, name, arch, cache):
    env = dict(os.environ, TILE_OPS_CACHE_DIR=cache)
    t_spawn = time.monotonic()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode, "--kernel", name,
                           "--arch", arch], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run of {name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    res["start_to_ready_s"] = res.pop("t_ready") - t_spawn
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", help="target arch (default: the local GPU's, else sm_90a)")
    p.add_argument("--kernel", choices=sorted(KERNELS), action="append", help="default: all")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.kernel[0], args.arch)
        return

    import torch

    from tile_ops.jit import default_arch

    gpu = torch.cuda.is_available()
    arch = args.arch or default_arch()
    device = torch.cuda.get_device_name() if gpu else "no GPU"
    rows = []
    for name in args.kernel or list(KERNELS):
        op, (M, N, K), dtype = KERNELS[name]
        with tempfile.TemporaryDirectory(prefix="tile_ops_compile_time_") as cache:
            cold = run_child("cold", name, arch, cache)
            warm = run_child("warm", name, arch, cache)
        assert cold["key"] == warm["key"]
        trace, lower, nvcc, check = (cold.get(k) for k in ("trace_s", "lower_s", "nvcc_s", "check_s"))
        other = cold["factory_s"] - trace - lower - nvcc - check if None not in (trace, lower, nvcc, check) else None
        fmt = lambda v, d=2: "n/a" if v is None else f"{v:.{d}f}"  # noqa: E731
        rows.append({
            "kernel": name, "shape": f"{M}x{N}x{K}", "dtype": dtype, "arch": arch,
            "cold_tvm_import_s": fmt(cold["tvm_import_s"]),
            "cold_compile_s": fmt(cold["factory_s"]), "trace_s": fmt(trace), "lower_s": fmt(lower),
            "codegen_s": fmt(cold.get("codegen_s")), "nvcc_s": fmt(nvcc),
            "check_s": fmt(check), "other_s": fmt(other),
            "warm_" + ("start_to_first_launch_s" if warm["launched"] else "start_to_kernel_ready_s"):
                fmt(warm["start_to_ready_s"]),
            "warm_import_s": fmt(warm["import_s"]), "warm_factory_ms": fmt(warm["factory_s"] * 1e3, 1),
            "warm_launcher": f"{warm['launcher']} {warm['launcher_s']:.2f}s", "warm_launch_s": fmt(warm.get("launch_s")),
            "warm_tvm_imported": warm["tvm_imported"],
        })
    columns = list(dict.fromkeys(c for r in rows for c in r))
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print(f"\nCompile time, cold (empty cache) and warm (new process, disk hit) on {device}, nvcc "
          f"{cold.get('nvcc') or '?'}")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))
    if not gpu:
        print("(no GPU: the warm column is process start to kernel ready; nothing was launched)")
    if any(r["warm_tvm_imported"] for r in rows):
        print("WARNING: the warm (cache hit) path imported TVM")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "arch": arch, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

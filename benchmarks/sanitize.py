"""compute-sanitizer over the library's kernels: memcheck, racecheck and synccheck, one small and two
ragged shapes of each kernel, on both code paths (issue 4 item 6).

    python benchmarks/sanitize.py [--out DIR] [--jobs 8] [--tools memcheck racecheck synccheck]
                                  [--timeout 150] [--budget 370] [--only gemm] [--paths sm_90a] [--dry-run]
                                  [--shapes cluster-walk deferred deferred-ragged]

Kernels: ``gemm`` (the library factory, tile_ops.kernels.gemm, with its default config for the shape and
path; the ragged shapes also take the bias), ``gemm_softmax`` (tile_ops.kernels.gemm_softmax, default
config), ``matmul20`` (the README's 20-line matmul, tests/programs.py, default tiles), ``pad_rows``
(the copy build_gemm puts before a gemm whose rows TMA cannot load) and ``attention`` (the FlashAttention
forward, tile_ops.kernels.attention, default config; its shapes are (Sq, Sk, head dim)).  Paths: ``sm_90a``
(TMA + wgmma, warp-specialized, when the copies are TMA-eligible) and ``sm_90`` (cp.async + mma.sync) on
the same GPU.  Shapes: a small one, a ragged one whose rows are not 16-byte aligned (so sm_90a falls back
to non-TMA copies) and a ragged one whose rows are 16-byte aligned but whose M/N/K are not tile multiples
(so sm_90a takes the TMA path with out-of-bounds boxes).

The parent compiles every kernel first (or loads it from the tile_ops cache: $TILE_OPS_CACHE_DIR), so a
child only loads a cubin.  Each run is one child process of this script under
``compute-sanitizer --tool T --error-exitcode 1``: it makes fp16 inputs on the CPU, copies them to the GPU
(plain memcpys), fills the output with NaN (a memcpy), launches the kernel once, copies the output back and
checks it against torch in float64 on the CPU, so no torch kernel runs and nothing but our kernel is
checked (no --kernel-name filter is needed, and none can silently filter ours out).  The child runs with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so every tensor is its own cudaMalloc and memcheck (with --padding 512)
sees an access past the end of a tensor instead of a hit inside torch's pooled segment.

What each tool covers:
  memcheck   out-of-bounds / misaligned global, local and shared accesses, hardware exceptions, CUDA API
             errors.  TMA (cp.async.bulk.tensor) and wgmma are checked as far as the installed
             sanitizer's --check-bulk-copy / --check-warpgroup-mma support goes (both default to yes).
             TMA boxes that hang off the tensor's edge are clipped by the hardware (zero-filled loads),
             which is not an error.
  racecheck  shared-memory data hazards (RAW/WAR/WAW) between threads of a block, ordered by the barriers
             racecheck tracks (__syncthreads/bar.sync, named barriers, and mbarriers to the extent of its
             support).  It does not look at global memory.  On the sm_90a path the shared tiles are
             written by TMA (async proxy) and read by wgmma through descriptors, synchronized by
             mbarrier arrive/expect_tx/try_wait: if racecheck does not model that, it can report hazards
             that are false positives.  The table shows every reported hazard anyway (nothing is
             suppressed); the log under --out has the PCs and the accesses to judge each one.
  synccheck  invalid barrier use: divergent __syncthreads / bar.sync, mismatched counts, misuse of warp
             synchronization and (where supported) wgmma fences.
Any result other than "clean" (errors, racecheck warnings, a wrong result, a crash, a timeout, a run skipped
for --budget) makes the exit status 1.  The table printed last has one row per (kernel, path, shape) and
one column per tool, "result (seconds)"; OUT/sanitize/summary.json has one record per run and
OUT/sanitize/<kernel>_<path>_<label>_<shape>_<tool>.log each run's command line and full sanitizer output.
--budget caps the whole script (compiling included), so that under an outer `timeout` the table is still
printed: a run is not started with less than 20 s left, and a started run's timeout is cut to what is left.
"""

import argparse
import concurrent.futures as cf
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KERNELS = ("gemm", "gemm_softmax", "matmul20", "pad_rows", "attention")
PATHS = ("sm_90a", "sm_90")
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
DEFAULT_TOOLS = ("memcheck", "racecheck", "synccheck")
# (label, (M, N, K)): small, ragged with unaligned rows (no TMA: the gemm kernel itself, which build_gemm
# would pad for TMA on sm_90a), ragged with 16-byte aligned rows (TMA); pad_rows: (rows, cols, padded)
SHAPES = {
    "pad_rows": [("small", (16, 120, 128)), ("ragged", (1234, 3001, 3008))],
    "gemm": [("small", (128, 128, 128)), ("ragged", (127, 255, 129)), ("ragged-tma", (200, 136, 72)),
             ("short-grid", (768, 1024, 136)),  # sm_90a: pairs of 64-row tiles in clusters (B multicast)
             # the same pairs (2000-byte B rows keep them), 128-deep: 8 k-steps on 4 stages (wraps); K > 2048:
             # 64-deep, 36 k-steps on 8 stages (wraps); rows of whole 128-byte lines: the same tiles unclustered
             ("short-grid-wrap", (768, 1000, 1024)), ("short-grid-long-k", (768, 1000, 2304)),
             ("short-grid-lines", (768, 1024, 1024)),
             # not whole lines, 14 x 8 tiles of 72x128: swapped, 2x4 clusters, 16 k-steps on 8 stages
             ("short-grid-swapped", (1000, 1000, 1024)),
             ("wide", (1500, 1704, 72)),  # sm_90a: one wave of 128x192 tiles in pairs, ragged
             ("padded", (127, 255, 129)),  # sm_90a: the gemm build_gemm runs after pad_rows (rows of 136, 256)
             ("decode", (5, 4104, 200))],  # sm_90a: the swapped kernel (C^T = B^T A^T), 65 ragged column tiles
    "matmul20": [("small", (128, 128, 128)), ("ragged", (127, 255, 129)), ("ragged-tma", (200, 136, 72))],
    "gemm_softmax": [("small", (128, 256, 64)), ("ragged", (127, 255, 129)), ("ragged-tma", (1000, 200, 96)),
                     # sm_90a clusters: 8 blocks a row with a tile each; 5 blocks walking ragged tiles
                     ("cluster", (256, 2048, 64)), ("cluster-walk", (200, 2312, 72)),
                     ("cluster-wrap", (128, 2048, 200)),  # one tile a block, 4 k-steps on 3 stages
                     # the same walk over one k-step a tile: its 3-stage pipeline never wraps, which is
                     # the walk racecheck finishes (15 s; cluster-walk's never has, not in 520 s)
                     ("cluster-walk-1k", (200, 2312, 8)),
                     # sm_90a T.row_reduce_store: rows over the grid, statistics through the workspace
                     ("deferred", (512, 1024, 512)), ("deferred-ragged", (300, 776, 520))],
    # the FlashAttention forward: (Sq, Sk, head dim), one batch, 4 query heads over 2 K/V heads
    "attention": [("small", (128, 128, 64)), ("ragged", (77, 300, 128)), ("causal-ragged", (300, 213, 64)),
                  ("causal-d256", (130, 130, 256))],
}
SCALE = 0.125  # gemm_softmax's scale
RTOL = 1e-2  # max |out - ref| <= RTOL * max |ref| (fp16 output, fp32 accumulation)
TOOL_ARGS = {"memcheck": ["--padding", "512", "--leak-check", "no"], "racecheck": [], "synccheck": [],
             "initcheck": []}


def shape_str(shape):
    return "x".join(map(str, shape))


def build(kernel, arch, shape, label):
    """The tile_ops.Kernel for one (kernel, path, shape): compiled, or loaded from the cache."""
    M, N, K = shape
    if kernel == "gemm":  # the kernel the op launches: M at run time (its pads: the "padded" case's)
        from tile_ops.kernels.gemm import gemm
        from tile_ops.kernels.gemm_defaults import default_config
        from tile_ops.kernels.gemm_launch import gemm_call

        args, kwargs = gemm_call(M, N, K, 1, 1, 1, False, False, label != "small", "float16", "float16",
                                 default_config(M, N, K, arch), target=arch, pad=label == "padded")
        return gemm(*args, **kwargs, target=arch)
    if kernel == "gemm_softmax":
        from tile_ops.kernels.gemm_softmax import gemm_softmax
        from tile_ops.kernels.gemm_softmax_defaults import default_config
        from tile_ops.kernels.gemm_softmax_launch import gemm_softmax_call

        args, kwargs = gemm_softmax_call(M, N, K, SCALE, "float16", "float16", default_config(M, N, K, arch))
        return gemm_softmax(*args, **kwargs, target=arch)
    if kernel == "pad_rows":
        from tile_ops.kernels.gemm import pad_rows

        return pad_rows(1, None, N, K, "float16", target=arch)
    if kernel == "attention":
        from tile_ops.kernels.attention_launch import build_attention

        return build_attention(dict(dim=K, dtype="float16", causal="causal" in label, local=False, softcap=False,
                                    alibi=False), arch=arch)
    if kernel == "matmul20":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from programs import matmul

        return matmul(M, N, K, target=arch)
    raise ValueError(f"unknown kernel {kernel}")


def out_position(k):
    n = len(k.meta.params)
    (pos,) = [i for i in range(n) if i in k.meta.out_idx or i - n in k.meta.out_idx]
    return pos


def param_shape(k, i, M):
    """Parameter i's shape with M, the kernels' one runtime size, given."""
    from tile_ops.compiler.meta import evaluate

    return tuple(evaluate(d, {"M": M}) for d in k.meta.params[i][1])


def make_tensors(k, seed, M):
    """CPU tensors for every parameter of ``k`` at M: fp16 inputs ~ N(0, 1), outputs filled with NaN."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (name, _, dtype) in enumerate(k.meta.params):
        shape = param_shape(k, i, M)
        dt = getattr(torch, dtype)
        if i == out_position(k):
            out.append(torch.full(shape, float("nan"), dtype=dt))
        else:
            out.append(torch.randn(shape, generator=g, dtype=torch.float32).to(dt))
    return out


def reference(kernel, tensors, label, shape):
    """(output position, float64 reference) for the tensors of ``make_tensors`` of the (M, N, K) ``shape``."""
    import torch

    if kernel == "pad_rows":  # the rows, then zeros
        x, y = tensors
        ref = torch.zeros(y.shape, dtype=torch.float64)
        ref[..., :x.shape[-1]] = x.double()
        return 1, ref
    if kernel == "gemm":  # padded rows hold random values: only the logical M x K and K x N take part
        M, N, K = shape
        a, b, bias, _ = (t.double() for t in tensors)
        ref = a[0, :, :K] @ b[0, :, :N] + (bias if label != "small" else 0)
        return 3, ref[None]
    a, b, _ = (t.double() for t in tensors)
    ref = a @ b
    if kernel == "gemm_softmax":
        ref = torch.softmax(SCALE * ref, -1)
    return 2, ref


def check(kernel, tensors, out, label, shape):
    """(ok, relative max error): ``out`` (on the CPU) against the float64 reference; NaN (unwritten) fails."""
    _, ref = reference(kernel, tensors, label, shape)
    out = out.double()
    if out.shape != ref.shape:
        return False, float("inf")
    if not bool(out.isfinite().all()):
        return False, float("nan")
    err = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return err <= RTOL, err


def attention_child(arch, Sq, Sk, D, label):
    """The attention kernel under the sanitizer: (1, S, H, D) inputs, out and LSE poisoned with NaN."""
    import torch

    from tile_ops.kernels.attention_launch import launch_attention
    from tile_ops.ops.attention import attention_reference

    g = torch.Generator().manual_seed(Sq * 1009 + Sk)
    cpu = [torch.randn(1, n, h, D, generator=g).half() for n, h in ((Sq, 4), (Sk, 2), (Sk, 2))]
    q, k, v = (t.to("cuda") for t in cpu)
    out = torch.full((1, Sq, 4, D), float("nan"), dtype=torch.float16).to("cuda")
    lse = torch.full((1, 4, Sq), float("nan")).to("cuda")
    causal = "causal" in label
    launch_attention(q, k, v, out, lse, causal=causal, arch=arch)
    torch.cuda.synchronize()
    ref, ref_lse = attention_reference(*(t.double() for t in cpu), causal=causal, return_lse=True)
    out, lse = out.cpu().double(), lse.cpu().double()
    finite = ~ref_lse.isinf()
    ok = bool(out.isfinite().all()) and torch.equal(lse.isinf(), ref_lse.isinf())
    err = ((out - ref).abs().max() / ref.abs().max()).item() if ok else float("nan")
    ok = ok and err <= RTOL and (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-2
    print(f"sanitize child: attention {arch} {Sq}x{Sk}x{D} {label} max rel err {err:.2e}: "
          f"{'ok' if ok else 'WRONG RESULT'}", flush=True)
    sys.exit(0 if ok else 3)


def child(kernel, arch, M, N, K, label):
    """Runs under compute-sanitizer: load, launch once, check, exit (0 ok, 3 wrong result)."""
    import torch

    if kernel == "attention":
        return attention_child(arch, M, N, K, label)
    shape = (M, N, K)
    k = build(kernel, arch, shape, label)
    if "tvm" in sys.modules:
        print("sanitize child: WARNING: the kernel was compiled here (not in the cache); the parent should "
              "have built it", flush=True)
    cpu = make_tensors(k, seed=M * 1000003 + N * 1009 + K, M=M)
    dev = [t.to("cuda") for t in cpu]  # memcpys only: no torch kernel runs under the sanitizer
    k.launch(*dev)
    torch.cuda.synchronize()
    out_pos = out_position(k)
    ok, err = check(kernel, cpu, dev[out_pos].cpu(), label, shape)
    print(f"sanitize child: {kernel} {arch} {shape_str(shape)} {k!r} max rel err {err:.2e}: "
          f"{'ok' if ok else 'WRONG RESULT'}", flush=True)
    sys.exit(0 if ok else 3)


def shapes(kern, labels=None):
    """(label, shape) of ``kern``'s sanitizer shapes, only those named in ``labels`` when given."""
    return [(label, shape) for label, shape in SHAPES[kern] if not labels or label in labels]


def plan(kernels, paths, tools, labels=None):
    return [(kern, arch, label, shape, tool) for kern in kernels for arch in paths
            for label, shape in shapes(kern, labels) for tool in tools]


def sanitizer_cmd(sanitizer, run, port):
    kern, arch, label, (M, N, K), tool = run
    return ([sanitizer, "--tool", tool, "--error-exitcode", "1", "--target-processes", "application-only",
             "--port", str(port), "--print-limit", "200"] + TOOL_ARGS[tool] +
            [sys.executable, os.path.abspath(__file__), "--child", kern, arch, str(M), str(N), str(K), label])


def parse(text, rc, timed_out):
    """(result cell, clean?): clean / N errors[, M warnings] / wrong result / timeout / failed rc=X / no summary."""
    if timed_out:
        return "timeout", False
    errors = warnings = 0
    found = False
    for m in re.finditer(r"(?:ERROR|RACECHECK) SUMMARY:\s*(.*)", text):
        found = True
        line = m.group(1)
        e = re.search(r"(\d+) errors?", line)
        w = re.search(r"(\d+) warnings?", line)
        errors = max(errors, int(e.group(1)) if e else 0)
        warnings = max(warnings, int(w.group(1)) if w else 0)
    if errors or warnings:  # a racecheck warning is a reported hazard too: not clean, look at the log
        return f"{errors} errors" + (f", {warnings} warnings" if warnings else ""), False
    if "WRONG RESULT" in text:
        return "wrong result", False
    if rc != 0:
        return f"failed rc={rc}", False
    if not found:
        return "no summary", False
    return "clean", True


def run_one(sanitizer, run, port, out_dir, timeout, env):
    kern, arch, label, shape, tool = run
    cmd = sanitizer_cmd(sanitizer, run, port)
    # the label too: two labels can share a shape (gemm's ragged and padded runs are both 127x255x129)
    log = os.path.join(out_dir, f"{kern}_{arch}_{label}_{shape_str(shape)}_{tool}.log")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True, cwd=ROOT)
    timed_out = False
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        import signal

        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the sanitizer and the child it started: our own group
        except ProcessLookupError:
            pass
        text, _ = proc.communicate()
    secs = time.perf_counter() - t0
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n# rc={proc.returncode} timed_out={timed_out} seconds={secs:.1f}\n\n{text}")
    result, clean = parse(text, proc.returncode, timed_out)
    return {"kernel": kern, "path": arch, "shape": f"{label} {shape_str(shape)}", "tool": tool, "result": result,
            "clean": clean, "seconds": round(secs, 1), "rc": proc.returncode, "log": log}


def find_sanitizer(explicit):
    for c in (explicit, shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
              "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def precompile(kernels, paths, labels=None):
    """Build (or load) every kernel the runs need, in parallel: {(kernel, arch, label): Kernel or exception}."""
    todo = [(kern, arch, label, shape) for kern in kernels for arch in paths for label, shape in shapes(kern, labels)]

    def one(item):
        kern, arch, label, shape = item
        try:
            return build(kern, arch, shape, label)
        except Exception as e:  # reported in the table, not hidden
            return e

    with cf.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        built = list(pool.map(one, todo))
    return {(kern, arch, label): k for (kern, arch, label, _), k in zip(todo, built)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp", help="logs go to OUT/sanitize/")
    p.add_argument("--jobs", "-j", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    p.add_argument("--tools", nargs="+", choices=TOOLS, default=list(DEFAULT_TOOLS))
    p.add_argument("--only", nargs="+", choices=KERNELS, default=list(KERNELS), help="kernels")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--shapes", nargs="+", metavar="LABEL", choices=sorted({lb for v in SHAPES.values() for lb, _ in v}),
                   help="only the shapes with these labels (e.g. cluster-walk, with a longer --timeout)")
    p.add_argument("--timeout", type=float, default=150, help="seconds per sanitizer run")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole script (default: none)")
    p.add_argument("--sanitizer", help="path of compute-sanitizer (default: PATH, /usr/local/cuda/bin)")
    p.add_argument("--dry-run", action="store_true",
                   help="build every kernel, list the runs and their commands; no GPU, no sanitizer")
    p.add_argument("--child", nargs=6, metavar=("KERNEL", "ARCH", "M", "N", "K", "LABEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kern, arch, M, N, K, label = args.child
        return child(kern, arch, int(M), int(N), int(K), label)

    runs = plan(args.only, args.paths, args.tools, args.shapes)
    t0 = time.perf_counter()
    deadline = t0 + args.budget if args.budget else float("inf")
    built = precompile(args.only, args.paths, args.shapes)
    failed = {key: k for key, k in built.items() if isinstance(k, Exception)}
    print(f"built {len(built) - len(failed)}/{len(built)} kernels in {time.perf_counter() - t0:.1f} s "
          f"(cache: {os.environ.get('TILE_OPS_CACHE_DIR', '~/.tile_ops/cache')})", flush=True)
    for (kern, arch, label), e in failed.items():
        print(f"  BUILD FAILED {kern} {arch} {label}: {type(e).__name__}: {e}", flush=True)

    out_dir = os.path.join(args.out, "sanitize")
    sanitizer = find_sanitizer(args.sanitizer)
    if args.dry_run:
        # the child's CPU half: tensors from the kernel's parameters and the float64 reference
        for (kern, arch, label), k in built.items():
            if isinstance(k, Exception):
                continue
            shape = dict(SHAPES[kern])[label]
            if kern == "attention":  # its child checks itself (attention_child)
                print(f"  {kern:12} {arch:6} {label:10} {shape_str(shape):14} {k!r} "
                      f"tma={'yes' if k.meta.tensormaps else 'no'}")
                continue
            tensors = make_tensors(k, seed=0, M=shape[0])
            pos, ref = reference(kern, tensors, label, shape)
            assert pos == out_position(k) and tuple(ref.shape) == param_shape(k, pos, shape[0]), (
                kern, arch, label, ref.shape, k.meta.params)
            ok, _ = check(kern, tensors, tensors[pos], label, shape)  # the NaN-filled output must fail the check
            assert not ok, (kern, arch, label)
            ok, err = check(kern, tensors, ref.to(tensors[pos].dtype), label, shape)  # the rounded reference passes
            assert ok, (kern, arch, label, err)
            print(f"  {kern:12} {arch:6} {label:10} {shape_str(shape):14} {k!r} "
                  f"tma={'yes' if k.meta.tensormaps else 'no'}")
        print(f"{len(runs)} runs planned, {args.jobs} at a time, {args.timeout:.0f} s each at most; "
              f"sanitizer: {sanitizer or 'not found here'}; logs would go to {out_dir}")
        for i, run in enumerate(runs):
            print("  " + shlex.join(sanitizer_cmd(sanitizer or "compute-sanitizer", run, 30000 + 16 * i)))
        return 1 if failed else 0

    if sanitizer is None:
        print("compute-sanitizer not found (PATH, /usr/local/cuda/bin); give --sanitizer", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("no GPU: use --dry-run", file=sys.stderr)
        return 2
    from tile_ops.jit.launcher import get_launcher

    get_launcher()  # build the launcher extension here if it is missing, not under the sanitizer
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # the slowest first (racecheck, big shapes) so the pool ends together
    weight = {"racecheck": 3, "memcheck": 2, "initcheck": 2, "synccheck": 1}
    order = sorted(range(len(runs)), key=lambda i: (-weight[runs[i][4]], -runs[i][3][0] * runs[i][3][1]))
    results = [None] * len(runs)
    done = [0]
    lock = threading.Lock()
    print(f"{len(runs)} sanitizer runs, {args.jobs} at a time ({sanitizer}); logs in {out_dir}", flush=True)

    def go(i):
        kern, arch, label, shape, tool = runs[i]
        left = deadline - time.perf_counter()
        r = {"kernel": kern, "path": arch, "shape": f"{label} {shape_str(shape)}", "tool": tool, "clean": False,
             "seconds": 0.0, "rc": None, "log": None}
        if (kern, arch, label) in failed:
            e = failed[(kern, arch, label)]
            r.update(result="build failed", error=f"{type(e).__name__}: {e}")
        elif left < 20:
            r.update(result="skipped (budget)")
        else:
            r = run_one(sanitizer, runs[i], 30000 + 16 * i, out_dir, min(args.timeout, left - 10), env)
        results[i] = r
        with lock:
            done[0] += 1
            print(f"[{done[0]}/{len(runs)}] {kern} {arch} {r['shape']} {tool}: {r['result']} ({r['seconds']} s)",
                  flush=True)

    t1 = time.perf_counter()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(go, order))
    wall = time.perf_counter() - t1

    # one row per (kernel, path, shape), one column per tool: "result (seconds)"
    rows = {}
    for r in results:
        row = rows.setdefault((r["kernel"], r["path"], r["shape"]),
                              {"kernel": r["kernel"], "path": r["path"], "shape": r["shape"]})
        row[r["tool"]] = f"{r['result']} ({r['seconds']:.0f}s)"
    bad = [r for r in results if not r["clean"]]
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump({"sanitizer": sanitizer, "wall_s": round(wall, 1), "runs": results}, f, indent=1)
    title = (f"compute-sanitizer on {torch.cuda.get_device_name()}: {len(results) - len(bad)}/{len(results)} clean, "
             f"{wall:.0f} s wall, {args.jobs} at a time (logs: {out_dir})")
    sys.path.insert(0, HERE)
    from common import print_table

    for r in bad:
        print(f"NOT CLEAN: {r['kernel']} {r['path']} {r['shape']} {r['tool']}: {r['result']} -> {r['log']}")
    print_table(list(rows.values()), ["kernel", "path", "shape"] + list(args.tools), title)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

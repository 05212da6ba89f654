"""FlashAttention: ours beside SDPA's cuDNN and flash backends, TFLOP/s, one process.

    python benchmarks/bench_attention.py [--dtypes bf16,fp16] [--shapes NAME,...] [--configs C,...]
                                         [--backward] [--rep-ms 300] [--json out.json]

TFLOP/s count 4 * B * Hq * Sq * Sk * D, halved for causal (the work above the diagonal is skipped).  Each row
times ours (``tile_ops.flash_attn_func`` on (B, S, H, D) tensors) and the anchors (SDPA on (B, H, S, D)
tensors) call by call in turn (paired medians); ``vs_cudnn`` is cuDNN's time over ours.  Every row first checks
ours against SDPA's math in float32 (``err``: max |diff| / max |ref|).  ``--configs`` (block_M x block_N /
stages / threads, e.g. 128x128/2/256) times those configs of our kernel too, the fastest reported.
The varlen row: 64 sequences of 128-4096 tokens (seeded), ours packed against cuDNN on the same tokens padded
to the longest.

``--backward``: the backward instead, TFLOP/s counting 2.5x the forward's FLOPs: ours (Delta, the key-block
kernel, dQ's cast; ``det``: deterministic, dQ from its own kernel) against the anchors' backward kernels
(``torch.autograd.grad`` through SDPA with the graph kept), each checked first against SDPA's math in float32;
``step`` is forward + backward together, ours against cuDNN's.
"""

import argparse
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))
from common import paired_medians, print_table, save  # noqa: E402

import tile_ops  # noqa: E402
from tile_ops.kernels.attention_config import AttentionConfig  # noqa: E402
from tile_ops.kernels.attention_launch import attention_problem, build_attention  # noqa: E402

# name: (B, Hq, Hkv, S, D) — the table, then short sequences
SHAPES = {
    "b4-h32-s4096-d128": (4, 32, 32, 4096, 128),
    "b1-h32-s16384-d128": (1, 32, 32, 16384, 128),
    "b8-h16-s2048-d64": (8, 16, 16, 2048, 64),
    "b4-h32/8-s4096-d128": (4, 32, 8, 4096, 128),
    "b2-h16-s4096-d256": (2, 16, 16, 4096, 256),
    "b16-h32-s512-d128": (16, 32, 32, 512, 128),
}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def parse_config(s: str) -> AttentionConfig:
    blocks, stages, threads = s.split("/")
    bm, bn = blocks.split("x")
    return AttentionConfig(int(bm), int(bn), int(stages), int(threads))


def sdpa(backend, q, k, v, causal):
    """SDPA on (B, H, S, D) tensors with one backend; None where it cannot run them."""
    gqa = q.shape[1] != k.shape[1]

    def run():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    try:
        run()
        torch.cuda.synchronize()
    except RuntimeError as e:
        print(f"  {backend.name} refused: {str(e).splitlines()[0][:120]}", file=sys.stderr)
        return None
    return run


def ours(q, k, v, causal, cfg=None):
    """flash_attn_func's call, or (with ``cfg``) the kernel of that config launched like it."""
    if cfg is None:
        return lambda: tile_ops.flash_attn_func(q, k, v, causal=causal)
    kernel = build_attention(attention_problem(q, causal=causal), cfg)
    B, Sq, Hq, D = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, Sq, device=q.device)
    args = [t.transpose(1, 2) for t in (q, k, v, out)] + [lse]
    ptrs = [t.data_ptr() for t in args]
    values = kernel.values(kernel.dims.read(args), scale=D ** -0.5, softcap=0.0, window_left=-1, window_right=-1)
    return lambda: kernel.launch_ptrs(ptrs, q.device, values)


def error(q, k, v, causal) -> float:
    out = tile_ops.flash_attn_func(q, k, v, causal=causal).float()
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return ((out.transpose(1, 2) - ref).abs().max() / ref.abs().max()).item()


def bench_shape(name, shape, dtype, causal, configs, rep_ms):
    B, Hq, Hkv, S, D = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    flops = 4 * B * Hq * S * S * D / (2 if causal else 1)
    fns = {"ours": ours(q, k, v, causal)}
    for c in configs:
        try:
            fns[f"ours {c}"] = ours(q, k, v, causal, parse_config(c))
        except Exception as e:  # noqa: BLE001 - a config this head dim cannot take (shared memory): skipped
            print(f"  {name}: config {c} skipped: {str(e).splitlines()[0][:120]}", file=sys.stderr)
    for label, backend in BACKENDS.items():
        fn = sdpa(backend, qt, kt, vt, causal)
        if fn is not None:
            fns[label] = fn
    ms = paired_medians(fns, rep_ms=rep_ms)
    best = min((n for n in ms if n.startswith("ours")), key=ms.get)
    tf = {n: flops / ms[n] / 1e9 for n in ms}
    return dict(shape=name, dtype=str(dtype)[6:], causal=causal, err=f"{error(q, k, v, causal):.1e}",
                config=best[5:] or "default", ours=f"{tf[best]:.0f}", cudnn=f"{tf['cudnn']:.0f}" if "cudnn" in tf else "-",
                flash=f"{tf['flash']:.0f}" if "flash" in tf else "-",
                vs_cudnn=f"{ms['cudnn'] / ms[best]:.3f}" if "cudnn" in ms else "-")


def bench_backward(name, shape, dtype, causal, rep_ms):
    B, Hq, Hkv, S, D = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=dtype, generator=gen).requires_grad_()
               for h in (Hq, Hkv, Hkv))
    dout = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
    gqa = Hq != Hkv
    ours_out = {det: tile_ops.flash_attn_func(q, k, v, causal=causal, deterministic=det) for det in (False, True)}
    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), is_causal=causal,
                                                             enable_gqa=gqa), (qt, kt, vt), dout.transpose(1, 2))
    got = torch.autograd.grad(ours_out[False], (q, k, v), dout, retain_graph=True)
    err = max(((g.transpose(1, 2).float() - r.float()).abs().max() / r.float().abs().max()).item()
              for g, r in zip(got, ref))
    fns = {"ours": lambda: torch.autograd.grad(ours_out[False], (q, k, v), dout, retain_graph=True),
           "ours det": lambda: torch.autograd.grad(ours_out[True], (q, k, v), dout, retain_graph=True),
           "ours step": lambda: torch.autograd.grad(tile_ops.flash_attn_func(q, k, v, causal=causal), (q, k, v),
                                                    dout)}
    for label, backend in BACKENDS.items():
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
                torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
        except RuntimeError as e:
            print(f"  {backend.name} refused: {str(e).splitlines()[0][:120]}", file=sys.stderr)
            continue
        fns[label] = lambda o=o: torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)
        if label == "cudnn":
            def step(backend=backend):  # bound now: the loop goes on to the flash backend
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=gqa)
                return torch.autograd.grad(o, (qt, kt, vt), dout.transpose(1, 2))
            fns["cudnn step"] = step
    ms = paired_medians(fns, rep_ms=rep_ms)
    flops = 2.5 * 4 * B * Hq * S * S * D / (2 if causal else 1)
    tf = {n: flops / ms[n] / 1e9 for n in ms}
    get = lambda n: f"{tf[n]:.0f}" if n in tf else "-"  # noqa: E731
    ratio = lambda a, b: f"{ms[a] / ms[b]:.3f}" if a in ms else "-"  # noqa: E731
    return dict(shape=name, dtype=str(dtype)[6:], causal=causal, err=f"{err:.1e}", ours=get("ours"),
                det=get("ours det"), cudnn=get("cudnn"), flash=get("flash"), vs_cudnn=ratio("cudnn", "ours"),
                step_vs_cudnn=ratio("cudnn step", "ours step"))


def bench_varlen(dtype, rep_ms, n=64, H=32, D=128):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 4097, (n,), generator=gen).tolist()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    total, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, H, D, device="cuda", dtype=dtype) for _ in range(3))
    padded = [torch.zeros(n, H, longest, D, device="cuda", dtype=dtype) for _ in range(3)]
    fns = {"ours": lambda: tile_ops.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=True)}
    cudnn = sdpa(SDPBackend.CUDNN_ATTENTION, *padded, True)
    if cudnn is not None:
        fns["cudnn"] = cudnn
    ms = paired_medians(fns, rep_ms=rep_ms)
    flops = sum(4 * H * s * s * D / 2 for s in lengths)
    return dict(shape=f"varlen {n}x128-4096 h{H} d{D}", dtype=str(dtype)[6:], causal=True, err="-", config="default",
                ours=f"{flops / ms['ours'] / 1e9:.0f}", cudnn=f"{flops / ms['cudnn'] / 1e9:.0f}" if "cudnn" in ms else "-",
                flash="-", vs_cudnn=f"{ms['cudnn'] / ms['ours']:.3f}" if "cudnn" in ms else "-")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--shapes", default=None, help="names (default: all): " + ", ".join(SHAPES))
    p.add_argument("--configs", default="", help="also time these configs of our kernel, e.g. 128x128/2/256")
    p.add_argument("--no-varlen", action="store_true")
    p.add_argument("--backward", action="store_true", help="time the backward (and forward + backward)")
    p.add_argument("--rep-ms", type=int, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dtypes = [{"bf16": torch.bfloat16, "fp16": torch.float16}[d] for d in args.dtypes.split(",")]
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    configs = [c for c in args.configs.split(",") if c]
    rows = []
    if args.backward:
        for dtype in dtypes:
            for name in names:
                for causal in (False, True):
                    rows.append(bench_backward(name, SHAPES[name], dtype, causal, args.rep_ms))
                    print(rows[-1], file=sys.stderr)
        print_table(rows, ["shape", "dtype", "causal", "err", "ours", "det", "cudnn", "flash", "vs_cudnn",
                           "step_vs_cudnn"], f"FlashAttention backward, TFLOP/s on {torch.cuda.get_device_name()}")
        return save(rows, args.json)
    for dtype in dtypes:
        for name in names:
            for causal in (False, True):
                rows.append(bench_shape(name, SHAPES[name], dtype, causal, configs, args.rep_ms))
                print(rows[-1], file=sys.stderr)
        if not args.no_varlen:
            rows.append(bench_varlen(dtype, args.rep_ms))
    print_table(rows, ["shape", "dtype", "causal", "err", "config", "ours", "cudnn", "flash", "vs_cudnn"],
                f"FlashAttention forward, TFLOP/s on {torch.cuda.get_device_name()}")
    save(rows, args.json)


if __name__ == "__main__":
    main()

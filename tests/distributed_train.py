"""Multi-process training check for tile_ops under torch.distributed (run by torchrun).

    torchrun --nproc-per-node=2 tests/distributed_train.py --backend gloo --mode ddp
    torchrun --nproc-per-node=2 tests/distributed_train.py --backend nccl --mode tp

Builds a small transformer-style block twice from the same seed: once with torch's own
layers (``torch.nn.Linear``, ``softmax(q @ k^T) @ v`` attention) and once as a deep copy whose
Linear layers are converted with ``tile_ops.integrations.linear.convert_linears`` and whose
attention runs ``tile_ops.gemm_softmax`` + ``tile_ops.gemm``.  Both are wrapped the same way:

* ``ddp``:   ``DistributedDataParallel``; every rank trains on its own data.
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on the attention, the MLP and the root;
             every rank trains on its own data.
* ``tp``:    ``parallelize_module`` on a 1-D mesh: ``ColwiseParallel`` on ``mlp.fc1``,
             ``RowwiseParallel`` on ``mlp.fc2`` (their weights/biases become DTensors, so
             ``torch.ops.tile_ops.gemm`` receives DTensors; the sharding strategy the library
             registers, tile_ops/ops/sharding.py, lets DTensor run it on the local shards).
             All ranks see the same data.

Each model trains ``--steps`` steps of SGD on an MSE loss against a fixed random target; the
per-step losses, every step's gradients and the final parameters (full tensors:
``.full_tensor()`` for DTensors) must match between the two models: float32 on CPU within
1e-5 relative, bfloat16 on CUDA within 2e-2 (relative to the tensor's largest entry).

On CUDA (nccl) rank r uses ``cuda:{LOCAL_RANK}`` and every rank shares ``TILE_OPS_CACHE_DIR``
(from the environment), so the ranks compile kernels for their own device and fill the disk
cache at the same time; rank 0 then checks every cache entry loads intact and that no temp
directory is left under ``<cache>/tmp``.

``--dtype bfloat16`` on CPU runs the low-precision comparison without a GPU; ``--rtol`` overrides
the tolerance; ``TILE_OPS_DIST_VERBOSE=1`` prints every comparison.  Mismatches are gathered from
all ranks and raised together (AssertionError) after the last step.

Exit status 0 and a final line ``OK mode=... backend=... world=...`` on rank 0 on success.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import pathlib
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tile_ops
from tile_ops.integrations.linear import convert_linears


# --------------------------------------------------------------------------- model


class Attention(nn.Module):
    """Single-head self-attention: qkv projection, softmax(q k^T / sqrt(d)) v, output projection."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.use_tile_ops = False

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scale = 1.0 / math.sqrt(self.dim)
        if self.use_tile_ops:
            p = tile_ops.gemm_softmax(q, k.transpose(-1, -2), scale)
            o = tile_ops.gemm(p, v)
        else:
            p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * scale, dim=-1)
            o = torch.matmul(p, v)
        return self.proj(o)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """x (B, S, D) -> x + attn(ln1(x)) -> + mlp(ln2(.)) -> ln_f -> head (B, S, out)."""

    def __init__(self, dim: int, hidden: int, out: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.ln_f(x))


def to_tile_ops(model: Block) -> Block:
    """A deep copy of ``model`` running on tile_ops: every Linear converted, attention on tile_ops ops."""
    tm = convert_linears(copy.deepcopy(model))
    tm.attn.use_tile_ops = True
    n_lin = sum(isinstance(m, tile_ops.nn.Linear) for m in tm.modules())
    n_torch = sum(type(m) is nn.Linear for m in tm.modules())
    assert n_lin == 5 and n_torch == 0, (n_lin, n_torch)
    return tm


# --------------------------------------------------------------------------- wrapping


def wrap(model: Block, mode: str, device: torch.device, mesh):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        fully_shard(model.attn, mesh=mesh)
        fully_shard(model.mlp, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if mode == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        # tile_ops.nn.Linear is a torch.nn.Linear: torch's styles take it as it is.
        parallelize_module(model, mesh, {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
        from torch.distributed.tensor import DTensor

        assert isinstance(model.mlp.fc1.weight, DTensor) and isinstance(model.mlp.fc2.weight, DTensor)
        return model
    raise ValueError(mode)


def full(t):
    """The full (unsharded) value of a tensor or DTensor, as float32 on CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu()


def named_params(model):
    prefix = "module."
    return {(n[len(prefix):] if n.startswith(prefix) else n): p for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- checks


def assert_close(name, got, ref, rtol, low_precision=False):
    """Compare full tensors; returns the relative error.

    float32: ``max|got - ref| <= rtol * max|ref|`` (every element, plus a 1e-7 floor).
    float16/bfloat16 (``low_precision``): ``||got - ref|| <= rtol * ||ref||`` (Frobenius): the
    two models round different intermediates to 8 mantissa bits, and sums over rows of them
    (LayerNorm and bias gradients) can move single small entries by several ulps.
    """
    got, ref = full(got), full(ref)
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    if low_precision:
        what, err, scale = "||diff||", (got - ref).norm().item(), max(ref.norm().item(), 1e-6)
    else:
        what, err, scale = "max|diff|", (got - ref).abs().max().item(), max(ref.abs().max().item(), 1e-6)
    if os.environ.get("TILE_OPS_DIST_VERBOSE"):
        print(f"{name}: {err / scale:.2e}")
    if not err <= rtol * scale + 1e-7:
        raise AssertionError(f"{name}: {what} {err:.3e} > {rtol:g} * {scale:.3e} (tile_ops vs torch layers)")
    return err / scale


def check_cache(cache_root: pathlib.Path, expect_entries: bool) -> int:
    """Every entry under ``cache_root`` loads intact; no temp dirs left.  Returns the entry count."""
    from tile_ops.jit.cache import DiskCache

    dc = DiskCache(cache_root)
    keys = []
    if cache_root.is_dir():
        for shard in cache_root.iterdir():
            if shard.is_dir() and len(shard.name) == 2:
                keys += [e.name for e in shard.iterdir() if e.is_dir()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # load() warns (and deletes) on a corrupt entry
        for key in keys:
            assert dc.load(key) is not None, f"cache entry {key} under {cache_root} does not load"
    tmp = cache_root / "tmp"
    left = sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []
    assert not left, f"temp dirs left under {tmp}: {left}"
    if expect_entries:
        assert keys, f"no kernels were cached under {cache_root}"
    return len(keys)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--mode", choices=("ddp", "fsdp2", "tp"), default="ddp")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                    help="parameter/activation dtype; auto: float32 on CPU, bfloat16 on CUDA "
                         "(the CUDA kernels take float16/bfloat16 only)")
    ap.add_argument("--rtol", type=float, default=None,
                    help="override the tolerance (default 1e-5 for float32, 2e-2 for float16/bfloat16)")
    args = ap.parse_args(argv)
    # FSDP2 warns that a wrapped module returns a view (both Linears do for 3-D inputs); the
    # model never modifies those outputs in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    # CommDebugMode's module hooks (tp) see the input x, which needs no gradient.
    warnings.filterwarnings("ignore", message=r"Full backward hook is firing")

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if args.backend == "nccl":
        if torch.cuda.device_count() <= local_rank:
            raise SystemExit(f"rank {rank}: --backend nccl needs a GPU per process "
                             f"(LOCAL_RANK={local_rank}, {torch.cuda.device_count()} GPUs)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)  # this rank's kernels are compiled/loaded for its own GPU
    else:
        device = torch.device("cpu")
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    low = dtype in (torch.float16, torch.bfloat16)
    rtol = args.rtol if args.rtol is not None else (2e-2 if low else 1e-5)

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120),
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.debug import CommDebugMode

        mesh = init_device_mesh(device.type, (world,))  # (the library registers tile_ops::gemm's sharding)

        torch.manual_seed(1234)  # identical init on every rank and for both models
        ref = Block(args.dim, args.hidden, args.out).to(device=device, dtype=dtype)
        tile = to_tile_ops(ref)
        ref_w, tile_w = wrap(ref, args.mode, device, mesh), wrap(tile, args.mode, device, mesh)
        opt_ref = torch.optim.SGD(ref_w.parameters(), lr=args.lr)
        opt_tile = torch.optim.SGD(tile_w.parameters(), lr=args.lr)

        # TP: every rank of the TP group sees the same batch; DDP/FSDP: each rank its own.
        gen = torch.Generator().manual_seed(100 + (0 if args.mode == "tp" else rank))
        shape = (args.batch, args.seq, args.dim)
        data = [(torch.randn(shape, generator=gen).to(device, dtype),
                 torch.randn(args.batch, args.seq, args.out, generator=gen).to(device, dtype))
                for _ in range(args.steps)]

        # Mismatches are collected, not raised at once: full_tensor() is a collective, and a
        # rank that stopped early would leave the other one waiting in it.
        failures, worst = [], 0.0

        def check(name, got, ref):
            nonlocal worst
            try:
                worst = max(worst, assert_close(f"rank {rank} {name}", got, ref, rtol, low))
            except AssertionError as e:
                failures.append(str(e))

        losses = []
        for step, (x, target) in enumerate(data):
            step_losses, comms = [], []
            for model, opt in ((ref_w, opt_ref), (tile_w, opt_tile)):
                opt.zero_grad(set_to_none=True)
                cm = CommDebugMode() if args.mode == "tp" else None
                with cm or contextlib.nullcontext():
                    loss = F.mse_loss(model(x).float(), target.float())
                    loss.backward()
                step_losses.append(loss.detach())
                if cm is not None:
                    comms.append({str(k): v for k, v in cm.get_comm_counts().items()})
            l_ref, l_tile = step_losses
            if args.mode == "tp":
                # DTensor ran tile_ops::gemm on the local shards with the same collectives as
                # torch's Linear (one all-reduce forward after fc2, one backward before fc1),
                # not by gathering the shards.
                if comms[1] != comms[0]:
                    failures.append(f"rank {rank} step {step} TP collectives: tile_ops {comms[1]} vs torch {comms[0]}")
            check(f"step {step} loss", l_tile, l_ref)
            losses.append((l_ref.item(), l_tile.item()))

            p_ref, p_tile = named_params(ref_w), named_params(tile_w)
            assert p_ref.keys() == p_tile.keys(), (sorted(p_ref), sorted(p_tile))
            for name in p_ref:
                g_ref, g_tile = p_ref[name].grad, p_tile[name].grad
                assert g_ref is not None and g_tile is not None, f"{name}: missing grad"
                check(f"step {step} grad {name}", g_tile, g_ref)
            if args.mode == "ddp" and step == 0:
                # DDP all-reduced the tile_ops model's gradients: every rank holds the same ones.
                g = p_tile["mlp.fc1.weight"].grad.float()
                gathered = [torch.empty_like(g) for _ in range(world)]
                dist.all_gather(gathered, g)
                if not all(torch.equal(gathered[r], gathered[0]) for r in range(world)):
                    failures.append(f"rank {rank}: DDP left different mlp.fc1.weight gradients on the ranks")
            opt_ref.step()
            opt_tile.step()

        p_ref, p_tile = named_params(ref_w), named_params(tile_w)
        for name in p_ref:
            check(f"final param {name}", p_tile[name], p_ref[name])

        # Losses must actually differ across ranks for ddp/fsdp2 (per-rank data), match for tp.
        gathered = [None] * world
        dist.all_gather_object(gathered, (losses, failures))
        all_losses = [g[0] for g in gathered]
        all_failures = [f for g in gathered for f in g[1]]
        if world > 1:
            same = all(all_losses[r] == all_losses[0] for r in range(world))
            if same != (args.mode == "tp"):
                all_failures.append(f"per-rank losses {'match' if same else 'differ'}: {all_losses}")
        if all_failures:
            raise AssertionError(f"{len(all_failures)} mismatches (mode={args.mode}, {dtype}):\n"
                                 + "\n".join(all_failures[:40]))

        dist.barrier()
        if rank == 0:
            n_entries = None
            if device.type == "cuda":
                from tile_ops.jit.cache import cache_dir

                n_entries = check_cache(cache_dir(), expect_entries=True)
            print(f"losses (torch, tile_ops) per step on rank 0: {losses}")
            print(f"worst relative diff {worst:.2e} (tolerance {rtol:g}); cache entries: {n_entries}")
            if args.mode == "tp":
                print(f"TP collectives per step (torch, tile_ops): {comms}")
            print(f"OK mode={args.mode} backend={args.backend} world={world}", flush=True)
        dist.barrier()  # leave together: no rank tears its process group down under another's work
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's worker threads can still be joinable when C++ statics are
    # destroyed, which aborts ("terminate called without an active exception") after a clean run.
    os._exit(rc)

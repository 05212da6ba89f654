"""tile_ops under torch.distributed: DDP, FSDP2 (fully_shard) and DTensor tensor parallelism.

Each test launches ``tests/distributed_train.py`` with ``python -m torch.distributed.run
--nproc-per-node=2`` (MASTER_PORT from a freshly bound socket, so parallel runs don't collide).
The script trains a small transformer-style block built from tile_ops (``tile_ops.nn.Linear``,
attention on ``tile_ops.gemm_softmax`` + ``tile_ops.gemm``) next to the same block on torch's
own layers, wrapped the same way, and checks per-step losses, gradients and final parameters match.

* CPU / gloo: runs everywhere (CI); float32, 1e-5 relative.
* CUDA / nccl (``gpu`` marker): needs two GPUs; bfloat16, 2e-2 relative.  Both ranks share one
  TILE_OPS_CACHE_DIR, so they compile kernels for their own device and fill the disk cache at
  once; rank 0 and then this test check every entry loads intact with no temp dirs left.
"""

import os
import pathlib
import socket
import subprocess
import sys
import warnings

import pytest
import torch

from tile_ops.jit.cache import DiskCache

SCRIPT = pathlib.Path(__file__).with_name("distributed_train.py")
MODES = ("ddp", "fsdp2", "tp")
NPROC = 2


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(mode: str, backend: str, cache: pathlib.Path, extra_args=(), env=None, timeout=150) -> str:
    full_env = dict(os.environ, TILE_OPS_CACHE_DIR=str(cache), OMP_NUM_THREADS="1", **(env or {}))
    for attempt in range(2):
        # The port is free when bound here; another process may take it before torchrun does:
        # then (only then) try once more with a new one.
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc-per-node={NPROC}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
            str(SCRIPT), "--backend", backend, "--mode", mode, *extra_args,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"{' '.join(cmd)} timed out after {timeout}s:\n{e.stdout}\n{e.stderr}")
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or "address already in use" not in out.lower():
            break
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-8000:]}"
    assert f"OK mode={mode} backend={backend} world={NPROC}" in proc.stdout, out[-8000:]
    return proc.stdout


def cache_keys(root: pathlib.Path):
    if not root.is_dir():
        return []
    return [e.name for shard in root.iterdir() if shard.is_dir() and len(shard.name) == 2
            for e in shard.iterdir() if e.is_dir()]


# --------------------------------------------------------------------------- CPU / gloo


@pytest.mark.parametrize("mode", MODES)
def test_gloo_cpu_matches_torch_layers(mode, tmp_path):
    cache = tmp_path / "cache"
    # CUDA_VISIBLE_DEVICES="": the CPU reference path, even on a GPU machine.
    out = torchrun(mode, "gloo", cache, env={"CUDA_VISIBLE_DEVICES": ""})
    assert "worst relative diff" in out
    assert cache_keys(cache) == []  # the CPU path compiles nothing


def test_gloo_cpu_bfloat16_tp(tmp_path):
    """bfloat16 on CPU: the low-precision comparison (2e-2) the GPU runs use, with DTensor shards."""
    out = torchrun("tp", "gloo", tmp_path / "cache", extra_args=("--dtype", "bfloat16"),
                   env={"CUDA_VISIBLE_DEVICES": ""})
    assert "tolerance 0.02" in out


COMPILED_FIRST_CALL = """
import os, sys, torch
import tile_ops
assert "torch.distributed.tensor" not in sys.modules  # so the import registered nothing
f = torch.compile(lambda x, y: tile_ops.gemm(x, y), fullgraph=True)
x, y = torch.randn(8, 16), torch.randn(16, 4)
torch.testing.assert_close(f(x, y), x @ y)
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
a, b = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Replicate()])
torch._dynamo.reset()
out = f(a, b)  # the first tile_ops.gemm on DTensors is a compiled one
assert out.placements == (Shard(0),), out.placements
torch.testing.assert_close(out.full_tensor(), x @ y)
dist.destroy_process_group()
print("OK compiled first call")
"""


def test_dtensor_sharding_rules_register_on_a_compiled_first_call():
    """A process that imports tile_ops before DTensor and first calls tile_ops.gemm under torch.compile: the
    sharding rules are registered while dynamo traces (DTensor raised 'does not have a sharding strategy
    registered' when only an eager call registered them)."""
    proc = subprocess.run([sys.executable, "-c", COMPILED_FIRST_CALL, str(free_port())], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert "OK compiled first call" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


# --------------------------------------------------------------------------- CUDA / nccl


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < NPROC, reason=f"needs {NPROC} CUDA GPUs for nccl with one process each")
@pytest.mark.parametrize("mode", MODES)
def test_nccl_cuda_matches_torch_layers_and_shares_cache(mode, tmp_path):
    cache = tmp_path / "cache"  # fresh and shared: both ranks compile into it at the same time
    out = torchrun(
        mode, "nccl", cache,
        extra_args=("--dim", "64", "--hidden", "256", "--seq", "32"),
        env={"NCCL_NVLS_ENABLE": "0"},
        timeout=540,
    )
    assert "worst relative diff" in out
    keys = cache_keys(cache)
    assert keys, f"no kernels cached under {cache}:\n{out}"
    dc = DiskCache(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a corrupt entry warns in load()
        for key in keys:
            assert dc.load(key) is not None, key
    tmp = cache / "tmp"
    assert not tmp.is_dir() or list(tmp.iterdir()) == []

"""Recording the kernel problems of op calls (tile_ops/ops/record.py): on the CPU, what the CUDA path would
launch, once per distinct problem; nothing for calls that launch no kernel or that the op refuses."""

import json

import torch

import tile_ops
from tile_ops.ops import record

F16 = torch.float16


def test_cpu_calls_record_the_problems_their_cuda_run_launches():
    a, w = torch.randn(3, 40, 64, dtype=F16), torch.randn(96, 64, dtype=F16)
    with record.recording() as problems:
        tile_ops.gemm(a, w.t())  # (3, 40, 64) @ (64, 96), row-major: one (120, 64) @ (64, 96) problem
        tile_ops.gemm(a, w.t())
        tile_ops.gemm_softmax(a[0], w.t(), 0.5)
        tile_ops.gemm(a[:, :, :0], w[:, :0].t())  # K = 0: zeros, no kernel
    assert problems == [
        {"op": "gemm", "problem": dict(M=120, N=96, K=64, batch=1, batch_a=1, batch_b=1, trans_A=False, trans_B=True,
                                       has_bias=False, dtype="float16", out_dtype="float16", bias_dtype=None)},
        {"op": "gemm_softmax", "problem": dict(M=40, N=96, K=64, scale=0.5, dtype="float16", out_dtype="float16")}]


def test_the_record_file_gets_each_problem_once(tmp_path, monkeypatch):
    path = tmp_path / "record.jsonl"
    monkeypatch.setenv(record.ENV, str(path))
    a, b = torch.randn(8, 16, dtype=F16), torch.randn(16, 24, dtype=F16)
    for _ in range(3):
        tile_ops.gemm(a, b)
    tile_ops.gemm(a.float(), b.float())  # float32: computed on the CPU, no CUDA kernel of the op takes it
    lines = path.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["problem"]["M"] == 8
    assert record.read(str(path)) == [json.loads(lines[0])]

"""What the tuner needs to drive each op's kernel: build one config, make inputs, compute the reference.

The kernel modules own the configs (``config_space``, ``default_config``, ``shared_memory_bytes``);
this module only knows where they are and how to call each kernel the way its op does for a plain
row-major problem.  No torch or TVM import at module level.
"""

from __future__ import annotations

import importlib


class Target:
    """One tunable op.  ``inputs`` returns a tensor per kernel parameter, in order; the output is last."""

    name: str
    kernel: str  # tile_ops.kernels.<kernel>_config (config class, shared_memory_bytes), _defaults, _space, _launch
    config_name: str

    def module(self, part: str):
        return importlib.import_module(f"tile_ops.kernels.{self.kernel}_{part}")

    def config_class(self) -> type:
        return getattr(self.module("config"), self.config_name)

    def config_space(self, shape, dtype: str, arch: str) -> list:
        return self.module("space").config_space(*shape, dtype, arch)

    def default_config(self, shape, arch: str | None = None):
        return self.module("defaults").default_config(*shape, arch)

    def shared_memory_bytes(self, cfg, shape, dtype: str) -> int:
        return self.module("config").shared_memory_bytes(cfg, *shape, dtype)

    def flops(self, shape) -> int:
        M, N, K = shape
        return 2 * M * N * K


class GemmTarget(Target):
    name, kernel, config_name = "gemm", "gemm", "GemmConfig"

    def compile(self, shape, dtype: str, cfg, arch: str):
        M, N, K = shape
        # a split-K config builds two kernels (the gemm's partials, their reduction): one launchable
        return self.module("launch").build_gemm(M, N, K, 1, 1, 1, False, False, False, dtype, dtype, cfg, target=arch)

    def inputs(self, shape, dtype: str, device):
        import torch

        M, N, K = shape
        dt = getattr(torch, dtype)
        a, b = _operands(M, N, K, dt, device)
        bias = torch.zeros(N, dtype=dt, device=device)  # unused (has_bias=False) but a valid pointer
        return [a.unsqueeze(0), b.unsqueeze(0), bias, torch.empty(1, M, N, dtype=dt, device=device)]

    def reference(self, args):
        import torch

        return torch.matmul(args[0][0].float(), args[1][0].float())


class GemmSoftmaxTarget(Target):
    name, kernel, config_name = "gemm_softmax", "gemm_softmax", "SoftmaxConfig"

    def compile(self, shape, dtype: str, cfg, arch: str):
        M, N, K = shape
        program = importlib.import_module("tile_ops.kernels.gemm_softmax").gemm_softmax
        return program(M, N, K, 1.0, dtype, dtype, cfg, target=arch)

    def inputs(self, shape, dtype: str, device):
        import torch

        M, N, K = shape
        dt = getattr(torch, dtype)
        a, b = _operands(M, N, K, dt, device)
        return [a, b, torch.empty(M, N, dtype=dt, device=device)]

    def reference(self, args):
        import torch

        return torch.softmax(torch.matmul(args[0].float(), args[1].float()), dim=-1)


def _operands(M, N, K, dt, device):
    """Random A (M, K) and B (K, N) scaled so that A @ B has entries of about unit size."""
    import torch

    s = K ** -0.25
    return (torch.randn(M, K, device=device) * s).to(dt), (torch.randn(K, N, device=device) * s).to(dt)


TARGETS = {t.name: t for t in (GemmTarget(), GemmSoftmaxTarget())}


def get(op: str) -> Target:
    if op not in TARGETS:
        raise ValueError(f"tile_ops.autotune: unknown op {op!r}; tunable ops: {', '.join(TARGETS)}")
    return TARGETS[op]

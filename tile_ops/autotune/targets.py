"""What the tuner and the command line (``python -m tile_ops demo | precompile | tune``) need of each op's kernel:
its configs, how to build one, inputs and a reference to check it against, its FLOPs.  Each op's module
(tile_ops/ops/<op>.py) defines a :class:`Target`, which its ``OpSpec`` registers here.  No torch or TVM import at
module level.
"""

from __future__ import annotations

import abc
from typing import Callable, NamedTuple


class KernelConfigs(NamedTuple):
    """An op kernel's configs: its config dataclass (the tuned table stores it as a dict), the candidates
    ``space(M, N, K, dtype, arch)``, the ``default(M, N, K, arch)`` launched where the table has no entry, and an
    upper estimate ``shared_memory_bytes(cfg, M, N, K, dtype)``, to skip candidates that cannot fit unbuilt."""

    config: type
    space: Callable
    default: Callable
    shared_memory_bytes: Callable


class Target(abc.ABC):
    """An op's kernel, for a plain row-major problem of ``shape`` (three sizes: M, N, K for a matmul) in ``dtype``
    (a name: "float16")."""

    metavar = "MxNxK"  # what the three sizes are, on the command line
    scaled = False  # its kernel takes a scale as a compile-time constant (precompile --scale)
    speed = "TFLOP/s"  # how the demo reports its time: "TFLOP/s" (from flops) or "us"
    demo: list = []  # [(shape, dtype)] the demo builds, and with --quick
    demo_quick: list = []
    precompile: list = []  # the shapes precompile builds when given none

    @abc.abstractmethod
    def configs(self) -> KernelConfigs:
        """The kernel's configs, its modules imported here (on first use: the CPU path imports no kernel)."""

    def config_class(self) -> type:
        return self.configs().config

    def config_space(self, shape, dtype: str, arch: str) -> list:
        return self.configs().space(*shape, dtype, arch)

    def default_config(self, shape, arch: str | None = None):
        return self.configs().default(*shape, arch)

    def shared_memory_bytes(self, cfg, shape, dtype: str) -> int:
        return self.configs().shared_memory_bytes(cfg, *shape, dtype)

    @abc.abstractmethod
    def compile(self, shape, dtype: str, cfg, arch: str):
        """The launchable for ``cfg``: ``launch_ptrs(pointers, device)`` over ``inputs``' tensors, and ``meta``."""

    @abc.abstractmethod
    def problem(self, shape, dtype: str, scale: float = 1.0) -> dict:
        """The kernel problem (``OpSpec.problem``'s form, what TILE_OPS_RECORD writes) of a plain row-major call."""

    @abc.abstractmethod
    def kernel_call(self, problem: dict, arch: str) -> tuple:
        """((factory, args, kwargs) of the main kernel the op launches for ``problem``, a callable building all it
        launches: a gemm's pads and split-K reduction too)."""

    def launched(self, problem: dict, arch: str):
        """(the cache key of the main kernel the op launches for ``problem``, a callable building all it launches)."""
        (factory, args, kwargs), build = self.kernel_call(problem, arch)
        return factory.key(args, kwargs, arch), build

    def precompiled(self, problem: dict, arch: str):
        """``launched``, with what precompile builds for ``problem``: all the op's use of it launches (an op whose
        backward has kernels of its own builds them too)."""
        return self.launched(problem, arch)

    def problems(self, shape, dtype: str, scale: float = 1.0) -> list:
        """The problems precompile builds for ``shape``: the plain call's."""
        return [self.problem(shape, dtype, scale)]

    def shape_of(self, problem: dict):
        """The shape of a recorded ``problem`` (None where its kernels serve every size)."""
        return problem["M"], problem["N"], problem["K"]

    def launchable(self, kernel, shape, dtype: str):
        """``kernel`` as ``launch_ptrs(pointers, device)`` over ``inputs``' tensors (the demo's launch)."""
        return kernel

    def describe(self, problem: dict) -> str:
        """``problem`` in a few words, for tables: its sizes, then what differs from a plain row-major call."""
        M, N, K = problem["M"], problem["N"], problem["K"]
        plain = self.problem((M, N, K), problem["dtype"], problem.get("scale", 1.0))
        extra = " ".join(f"{k}={v}" for k, v in problem.items() if k not in ("M", "N", "K") and plain.get(k) != v)
        return f"{M}x{N}x{K} {problem['dtype']}" + (f" {extra}" if extra else "")

    @abc.abstractmethod
    def inputs(self, shape, dtype: str, device) -> list:
        """A tensor per kernel parameter, in order; the output is last."""

    @abc.abstractmethod
    def reference(self, args, scale: float = 1.0, dtype=None):
        """What the output of a launch on ``args`` should be, computed in ``dtype`` (default float32)."""

    @abc.abstractmethod
    def torch_equivalent(self, args, scale: float):
        """A callable computing the same with torch alone (what the demo times beside the kernel)."""

    @abc.abstractmethod
    def flops(self, shape) -> int:
        """The floating-point operations of one launch (the tuner's TFLOP/s)."""


TARGETS: dict[str, Target] = {}  # by op name, in registration order


def register(op: str, target: Target) -> None:
    TARGETS[op] = target


def get(op: str) -> Target:
    if op not in TARGETS:
        raise ValueError(f"tile_ops.autotune: unknown op {op!r}; tunable ops: {', '.join(TARGETS)}")
    return TARGETS[op]

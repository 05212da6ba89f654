"""CPU stand-ins for ``tile_ops.kernels.gemm_launch`` and ``tile_ops.kernels.gemm_softmax_launch``.

With them installed as the ops' kernels (the ``stand_in_kernels`` fixture of conftest.py), the ops' CUDA code paths
(checks, layouts, plans, the eager fast path) run on CPU tensors.  Like a real kernel, a stand-in
kernel is specialized on the shapes, strides and dtypes of the operands it was built for, and a
launch reads and writes memory only through the raw data pointers it is given: a launch on the
wrong pointers, or a plan reused for operands of another layout, gives wrong results.
"""

import contextlib
import ctypes
import importlib
import types
from typing import NamedTuple

import torch

from tile_ops.ops import fastpath

gemm_ops = importlib.import_module("tile_ops.ops.gemm")  # the modules (tile_ops.ops.gemm is the function)
softmax_ops = importlib.import_module("tile_ops.ops.gemm_softmax")

ALIGNMENT = 16


class Operand(NamedTuple):
    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @staticmethod
    def of(t):
        return Operand(tuple(t.shape), t.stride(), t.dtype)

    def at(self, ptr):
        """The tensor a kernel given ``ptr`` for this operand reads (a view of that memory)."""
        assert ptr % ALIGNMENT == 0, f"misaligned pointer 0x{ptr:x} handed to the kernel"
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        memory = (ctypes.c_byte * (extent * itemsize)).from_address(ptr)
        return torch.frombuffer(memory, dtype=self.dtype).as_strided(self.shape, self.stride)


def _kernel_layout_ok(t):
    _, R, C = t.shape
    return t.stride()[1:] in ((C, 1), (1, R))


class StandInGemm(types.ModuleType):
    """``tile_ops.kernels.gemm_launch``: ``get_gemm_kernel`` checks the glue's contract; launches compute on the CPU."""

    def __init__(self):
        super().__init__("tile_ops.kernels.gemm_launch")
        self.calls = []  # (a, b, out, bias) per kernel lookup, i.e. per launch of the checked path
        self.launches = 0

    def get_gemm_kernel(self, a, b, out, bias=None):
        assert a.dim() == b.dim() == out.dim() == 3
        Bt, M, K = a.shape
        assert b.shape[:2] == (Bt, K) and out.shape == (Bt, M, b.shape[2])
        assert _kernel_layout_ok(a) and _kernel_layout_ok(b), (a.stride(), b.stride())
        assert out.is_contiguous()
        if bias is not None:
            assert bias.shape == (out.shape[2],) and bias.is_contiguous() and bias.dtype == a.dtype
        self.calls.append((a, b, out, bias))
        kernel = (Operand.of(a), Operand.of(b), Operand.of(out), None if bias is None else Operand.of(bias))
        return kernel, a, b

    def gemm_launcher(self, kernel, device):
        a_op, b_op, out_op, bias_op = kernel

        def launch(a_ptr, b_ptr, out_ptr, bias_ptr=0):
            assert (bias_ptr != 0) == (bias_op is not None)
            acc = torch.matmul(a_op.at(a_ptr).float(), b_op.at(b_ptr).float())
            if bias_op is not None:
                acc = acc + bias_op.at(bias_ptr).float()
            out_op.at(out_ptr).copy_(acc)
            self.launches += 1

        return launch

    def gemm_plan(self, kernel, device, a, b, out, bias=None, scratch=None):
        """A host-code plan (fastpath.record takes a callable launch(*pointers of the plan's buffers)) on the op's
        plan buffers."""
        assert (a, b, out, bias, scratch) == (gemm_ops.A, gemm_ops.B, gemm_ops.OUT,
                                              None if kernel[3] is None else gemm_ops.BIAS, gemm_ops.SCRATCH)
        launch = self.gemm_launcher(kernel, device)
        return lambda a_ptr, b_ptr, bias_ptr, out_ptr: launch(a_ptr, b_ptr, out_ptr, bias_ptr)


class StandInGemmSoftmax(types.ModuleType):
    """``tile_ops.kernels.gemm_softmax_launch`` on the CPU, through raw pointers like ``StandInGemm``."""

    def __init__(self):
        super().__init__("tile_ops.kernels.gemm_softmax_launch")
        self.calls = []  # (a, b, out, scale) per kernel lookup
        self.launches = 0

    def get_gemm_softmax_kernel(self, a, b, out, scale):
        assert a.dim() == b.dim() == out.dim() == 2
        assert a.is_contiguous() and b.is_contiguous() and out.is_contiguous()
        assert a.shape[1] == b.shape[0] and out.shape == (a.shape[0], b.shape[1])
        self.calls.append((a, b, out, scale))
        return Operand.of(a), Operand.of(b), Operand.of(out), scale

    def gemm_softmax_launcher(self, kernel, device):
        a_op, b_op, out_op, scale = kernel

        def launch(a_ptr, b_ptr, out_ptr):
            s = torch.matmul(a_op.at(a_ptr).float(), b_op.at(b_ptr).float()) * scale
            out_op.at(out_ptr).copy_(torch.softmax(s, -1))
            self.launches += 1

        return launch

    def gemm_softmax_plan(self, kernel, device, a, b, out):
        assert (a, b, out) == (softmax_ops.A, softmax_ops.B, softmax_ops.OUT)
        return self.gemm_softmax_launcher(kernel, device)


class _NoDeviceSwitch(contextlib.nullcontext):
    """torch.cuda.device on CPU tensors: no switch.  A class, as torch's is: on a CUDA machine dynamo's own
    ``isinstance(x, torch.cuda.device)`` checks run while the stand-in is installed."""

    def __init__(self, device):
        super().__init__()


def install(monkeypatch):
    """Stand-in kernel modules as the ops' kernels, no CUDA device switch, and no plans; returns the two modules."""
    gemm, softmax = StandInGemm(), StandInGemmSoftmax()
    monkeypatch.setattr(gemm_ops, "_kernels", lambda: gemm)
    monkeypatch.setattr(softmax_ops, "_kernels", lambda: softmax)
    monkeypatch.setattr(torch.cuda, "device", _NoDeviceSwitch)
    fastpath.clear()
    return gemm, softmax

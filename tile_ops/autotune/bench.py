"""On-GPU measurement of one candidate: a correctness check, then CUDA-event timing on rotating inputs."""

from __future__ import annotations

import math
import statistics

TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2, "float32": 1e-4}  # relative Frobenius error vs fp32
MAX_COPIES = 256
MAX_COPY_BYTES = 2 << 30


class WrongResult(Exception):
    """A candidate's output does not match the float32 reference."""


class DeviceLost(RuntimeError):
    """A candidate's launch left the CUDA context unusable (e.g. an illegal address): tuning cannot go on."""


def input_copies(set_bytes: int, l2_bytes: int) -> int:
    """How many input sets to cycle through so that each launch finds its operands outside L2:
    enough to cover twice the L2, at least 2, bounded in count and memory."""
    want = math.ceil(2 * l2_bytes / max(1, set_bytes))
    return max(2, min(want, MAX_COPIES, MAX_COPY_BYTES // max(1, set_bytes)))


class GpuBench:
    """``bench(kernel, config) -> ms``: median time of one launch of ``kernel`` on ``target``'s inputs.

    The first launch is checked against ``target.reference`` (output poisoned with NaN beforehand);
    a mismatch raises :class:`WrongResult`.  Timing: warm-up for ``warmup_ms``, then ``reps`` samples,
    each a batch of launches cycling through the input copies between two CUDA events.
    """

    def __init__(self, target, shape, dtype: str, device=None, warmup_ms: float = 10.0, reps: int = 20,
                 sample_ms: float = 0.2):
        import torch

        self.device = torch.device(device if device is not None else "cuda")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.warmup_ms, self.reps, self.sample_ms = warmup_ms, reps, sample_ms
        self.tolerance = TOLERANCE[dtype]
        first = target.inputs(shape, dtype, self.device)
        set_bytes = sum(t.numel() * t.element_size() for t in first)
        n = input_copies(set_bytes, torch.cuda.get_device_properties(self.device).L2_cache_size)
        self.sets = [first] + [target.inputs(shape, dtype, self.device) for _ in range(n - 1)]
        self.ptrs = [[t.data_ptr() for t in s] for s in self.sets]
        self.expected = target.reference(first)

    def __call__(self, kernel, config=None) -> float:
        import torch

        with torch.cuda.device(self.device):
            try:
                self.check(kernel)
                return self.time(kernel)
            except WrongResult:
                raise
            except Exception as e:
                self._raise_if_context_lost(e)
                raise

    def _raise_if_context_lost(self, error: Exception) -> None:
        """A sticky CUDA error fails every later call too: stop instead of timing the rest as failures."""
        import torch

        try:
            torch.ones(1, device=self.device).add_(1)
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - any failure here means the context is gone
            raise DeviceLost(f"the CUDA context is unusable after this candidate failed ({error}); restart "
                             "the process and leave this config out (tune(..., configs=[...]))") from error

    def check(self, kernel) -> None:
        import torch

        out = self.sets[0][-1]
        out.fill_(float("nan"))
        kernel.launch_ptrs(self.ptrs[0], self.device)
        torch.cuda.synchronize(self.device)
        err = ((out.float() - self.expected).norm() / self.expected.norm()).item()
        if not err <= self.tolerance:  # NaN (an output element never written) fails too
            raise WrongResult(f"relative error {err:.2e} vs the float32 reference (tolerance {self.tolerance:g})")

    def _batch_ms(self, kernel, launches: int, start: int = 0) -> float:
        """Mean time of ``launches`` back-to-back launches, cycling through the input copies."""
        import torch

        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for i in range(start, start + launches):
            kernel.launch_ptrs(self.ptrs[i % len(self.ptrs)], self.device)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / launches

    def time(self, kernel) -> float:
        n = len(self.ptrs)
        estimate = max(self._batch_ms(kernel, n), 1e-4)
        self._batch_ms(kernel, max(n, math.ceil(self.warmup_ms / estimate)))
        per_sample = max(n, math.ceil(self.sample_ms / estimate))
        return statistics.median(self._batch_ms(kernel, per_sample, r * per_sample) for r in range(self.reps))

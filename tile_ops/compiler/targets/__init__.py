"""What the compiler knows of the GPU it builds for: the arch's limits from a table, its SM count from the
device when there is one (``Target``).  The instructions of each path live beside this: ``sm80`` (cp.async,
ldmatrix, mma.sync: every arch) and ``sm90`` (TMA, wgmma, mbarriers: sm_90a).  No TVM import here."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...lang import MAX_CLUSTER

# dynamic shared memory one block may opt in to, per SM version (the CUDA programming guide's table)
SMEM_LIMIT_BY_SM = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
SHARED_PER_SM = 228 * 1024  # sm_90: of which each resident CTA reserves 1 KiB
REGISTERS_PER_SM = 65536
MMA_TYPES = {"float16": "f16", "bfloat16": "bf16"}  # what mma.sync and wgmma multiply, in PTX's names
# SMs of the arch's data-center part, for a build without the GPU: A100, H100 SXM / H200, B200
SMS_BY_SM = {80: 108, 90: 132, 100: 148}


def sm_number(arch: str) -> int:
    """80 for sm_80, 90 for sm_90a."""
    return int(re.sub(r"\D", "", arch.split("_")[-1]))


def smem_limit(arch: str) -> int:
    """The most shared memory a block of ``arch`` can have; an unknown arch: the smallest of the table."""
    return SMEM_LIMIT_BY_SM.get(sm_number(arch), min(SMEM_LIMIT_BY_SM.values()))


def table_sms(arch: str) -> int:
    """The SM count assumed for ``arch`` without a device: the nearest older arch's in the table."""
    number = sm_number(arch)
    return SMS_BY_SM[max((n for n in SMS_BY_SM if n <= number), default=min(SMS_BY_SM))]


@dataclass(frozen=True)
class Target:
    """The GPU a kernel is built for: ``arch`` (sm_80, sm_90a, ...) and its number of SMs."""

    arch: str
    sms: int

    @staticmethod
    def of(arch: str, sms: int | None = None) -> "Target":
        return Target(arch, sms or table_sms(arch))

    @property
    def hopper(self) -> bool:
        """wgmma, TMA, clusters and setmaxnreg: the arch-specific sm_90a target."""
        return self.arch == "sm_90a"

    @property
    def smem_limit(self) -> int:
        return smem_limit(self.arch)

    def wave_ctas(self, cluster: int = 1) -> int:
        """Warp-specialized CTAs of one SM each that run at once in clusters of ``cluster`` (an estimate for
        clusters of 4 and 8: GPCs hold whole clusters), a multiple of ``cluster``."""
        if cluster <= 2:
            return self.sms // cluster * cluster
        return self.sms // MAX_CLUSTER * MAX_CLUSTER // cluster * cluster

"""``T.Pipelined(..., mma_turns=True)`` on the warp-specialized sm_90a path: the consumer warpgroups of a CTA
issue each step's leading tensor-core work in turns, warpgroup 0 then 1 (then 2 ...), so that while one's
wgmmas run the others do their math (FlashAttention-3's warpgroup ping-pong: one's softmax under another's
gemms).  Warpgroup w waits on named barrier ``TURN_BARRIER + w`` before its step's first wgmma and, after the
last one of the run, signals the next warpgroup's; the last warpgroup signals the first once at the start.
Every warpgroup takes as many turns (they walk the same steps), so the turns stay paired."""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script import builder as T

from ...lang.ir import Gemm
from ..cuda import emit_ptx

TURN_BARRIER = 5  # named barriers 5.. (1: the consumers' barrier, 2: pingpong's second, 3-4: its main-loop order)
WARPGROUP = 128


class Turns:
    def __init__(self, lw):
        self.lw = lw
        self.warpgroups = lw.threads // WARPGROUP

    def _warpgroup(self):
        return self.lw.wgmma_warpgroup  # bound before the consumers' body wherever there are several

    def start(self):
        """The last warpgroup hands the first its first turn."""
        with T.If(self._warpgroup() == self.warpgroups - 1):
            with T.Then():
                emit_ptx("bar.arrive", TURN_BARRIER, 2 * WARPGROUP)

    def take(self):
        emit_ptx("bar.sync", tirx.Cast("uint32", TURN_BARRIER + self._warpgroup()), 2 * WARPGROUP)

    def give(self):
        nxt = tirx.floormod(self._warpgroup() + 1, self.warpgroups)
        emit_ptx("bar.arrive", tirx.Cast("uint32", TURN_BARRIER + nxt), 2 * WARPGROUP)


def leading_gemms(nodes: list, touched):
    """(first, last) of the gemms a statement list starts with (the step's tensor-core issue), or None.  The run
    goes on over statements that leave its gemms' accumulators alone (``touched(node)``: the buffers a node
    reads or writes), e.g. the rescale of one accumulator between the gemm of another and its own; it ends
    before the first statement that would wait for one of them."""
    if not nodes or not isinstance(nodes[0], Gemm):
        return None
    accumulators, last = set(), None
    for n in nodes:
        if accumulators & {id(b) for b in touched(n)}:
            break
        if isinstance(n, Gemm):
            accumulators.add(id(n.C))
            last = n
    return nodes[0], last

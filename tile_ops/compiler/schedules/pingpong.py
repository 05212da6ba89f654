"""``T.Kernel(pingpong=True)`` on the warp-specialized path: two consumer warpgroups per CTA, each running
the program on alternate tiles of the persistent walk, so that one's epilogue overlaps the other's main
loop (CUTLASS's ping-pong).  Each has its own copy of what is not a pipeline stage (memory.py) and its own
named barrier; their main loops take the pipeline's steps in turns."""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script import builder as T

from ..cuda import emit_ptx

CONSUMERS = 2
MAINLOOP_ORDER = 3  # warpgroup w's main loop waits on named barrier 3 + w for the other's to end


class PingPong:
    def __init__(self, lw, steps_per_tile: int):
        self.lw, self.steps = lw, steps_per_tile

    def start(self, steps):
        """At the consumers' start: the program sees its own warpgroup's thread index, and the warpgroup's
        pipeline count starts at its first tile's steps."""
        lw = self.lw
        lw.tid = tirx.floormod(lw.tid, lw.threads)
        T.buffer_store(steps, lw.consumer * self.steps, [0])

    def next_tile(self, steps):
        """After a tile: the other warpgroup's tile takes the next steps."""
        T.buffer_store(steps, steps[0] + (CONSUMERS - 1) * self.steps, [0])

    def main_loop(self, run):
        """A warpgroup waits on the stages' parities only once the other has waited on every earlier step
        (the barriers are then at most one phase behind the step it waits for), and its main loop runs
        while the other's epilogue does."""
        lw, walk = self.lw, self.lw.ws.walk
        me = tirx.Cast("uint32", lw.consumer)
        both = lw.threads * CONSUMERS
        with T.If(walk.tile_ordinal > 0):
            with T.Then():
                emit_ptx("bar.sync", MAINLOOP_ORDER + me, both)
        run()
        with T.If(walk.tile_ordinal + 1 < walk.cta_tiles):  # the CTA's next tile is the other's
            with T.Then():
                emit_ptx("bar.arrive", MAINLOOP_ORDER + (1 - me), both)

"""``T.deferred()``: the end of a pipelined loop's iteration, which may run during the next iteration at the
block's place.  The loop's schedule lowers it: the warp-specialized main loop runs iteration t's block in
iteration t + 1 (``split``), so the block's wgmmas overlap the statements after it; every other loop runs it
at the end of its own iteration (``in_order``).  Both compute the same where the block does not touch what
the statements before it write, nor writes what they read (``check``)."""

from __future__ import annotations

from ...lang.ir import Deferred, error
from . import Container, tile_op, unit


@tile_op(Deferred)
class DeferredOp(Container):
    def lower(self, lw, node, vm):
        raise error(node.loc, "internal: a T.deferred() block reached the lowering unspliced by its loop")


def block_of(body: list):
    """The T.deferred() node of a loop body, or None."""
    return next((n for n in body if isinstance(n, Deferred)), None)


def in_order(body: list) -> list:
    """The loop body with its deferred block's statements at its end (what the loop computes)."""
    block = block_of(body)
    return body if block is None else [n for n in body if n is not block] + block.body


def split(body: list) -> tuple:
    """(the body with the deferred block's statements spliced in at its place, those statements)."""
    block = block_of(body)
    if block is None:
        return body, []
    at = body.index(block)
    return body[:at] + block.body + body[at + 1:], block.body


def check(loop, buffers: dict, loads: list) -> None:
    """Running the block one iteration late must compute what running it at the end of its iteration does: it
    holds the previous iteration's tiles while the loop loads the next (two stages at least), and commutes with
    the statements before it (the loop's ``loads``, whose tiles are the next stage's, aside)."""
    block = block_of(loop.body)
    if block is None:
        return
    if loop.num_stages < 2:
        raise error(block.loc, f"T.deferred(): the loop has num_stages={loop.num_stages}; a block run one iteration "
                               f"late still reads its iteration's tiles while the next iteration's load, so the "
                               f"loop needs num_stages >= 2")
    reads = {id(b) for n in block.body for b in unit(n).reads(n, buffers)}
    writes = {id(b): b for n in block.body for b in unit(n).writes(n)}
    for node in loop.body[:loop.body.index(block)]:
        if any(node is c for c in loads):
            continue
        op = unit(node)
        theirs = {id(b): b for b in op.writes(node)}
        clash = [b for i, b in writes.items() if i in theirs or any(id(r) == i for r in op.reads(node, buffers))] \
            + [b for i, b in theirs.items() if i in reads]
        if clash:
            raise error(block.loc, f"T.deferred(): the block may run during the next iteration after line "
                                   f"{node.loc.lineno if node.loc else '?'} ({node.loc.line if node.loc else node}), "
                                   f"and both touch {clash[0].name} where one writes it; move that statement after "
                                   f"the block, or the block's use of {clash[0].name} out of it")

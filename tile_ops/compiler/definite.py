"""Registers read before anything writes them: a fragment (``T.alloc_fragment``) or per-thread array
(``T.alloc_local``) starts as whatever the registers held, so a read before its first write (a gemm
accumulating into an uncleared accumulator, a copy out before the gemm) is a silent wrong answer.

The rule is simple and never rejects a program that writes before it reads: walk the program in the order it
runs, keeping the register buffers some statement before has written (partial writes, e.g. one row, count),
and refuse a tile op's read (``TileOp.reads``) of one not among them.  A loop body runs in order from the
buffers written before the loop (its first iteration: what a later statement of the body writes is not yet
written), with its ``T.deferred()`` block at its end (``deferred.in_order``); after the loop, what its body
writes counts as written, since a loop that runs at all writes it and rejecting that would refuse kernels
correct for every size they run with.  A loop of no iterations is skipped: it neither reads nor writes."""

from __future__ import annotations

from ..lang import ir
from ..lang.ir import error, walk
from .ops import unit
from .ops.deferred import in_order

REGISTERS = ("fragment", "local")  # the scopes whose storage starts undefined in every thread


def check_written_before_read(kernel: ir.Kernel, buffers: dict) -> None:
    """A TileLangError at the first read of a fragment or local array that nothing before it has written."""
    _run(kernel.body, set(), buffers, loops=[])


def _run(body: list, written: set, buffers: dict, loops: list) -> None:
    """Walk ``body`` in execution order, adding to ``written`` what it writes."""
    for node in in_order(body):
        inner = getattr(node, "body", None)
        if isinstance(node, ir.For):
            if not _never_runs(node):
                _run(node.body, written, buffers, loops + [node])
        elif inner is not None and not isinstance(node, ir.Kernel):  # T.Parallel, T.row_reduce_store's ops
            _run(inner, written, buffers, loops)
        else:
            _check_reads(node, written, buffers, loops)
            written.update(b for b in unit(node).writes(node) if b.scope in REGISTERS)


def _never_runs(loop: ir.For) -> bool:
    """A loop of no iterations (``T.serial(0)``, which tests use to lay fragments out): its body reads nothing."""
    extent = loop.extent
    return (extent if isinstance(extent, int) else getattr(extent, "value", None)) == 0  # (an IntImm's value)


def _check_reads(node, written: set, buffers: dict, loops: list) -> None:
    for buf in unit(node).reads(node, buffers):
        if buf.scope in REGISTERS and buf not in written:
            raise error(node.loc, _unwritten(node, buf, loops))


def _unwritten(node, buf, loops: list) -> str:
    """What is wrong with reading ``buf`` at ``node``, and how to write it first."""
    what = "fragment" if buf.scope == "fragment" else "local array"
    later = _written_later_in(loops, buf, node)
    when = (f"on the first iteration of the loop, before line {later.loc.lineno if later.loc else '?'} writes it"
            if later is not None else "before anything writes it")
    return (f"{what} {buf.name} is read here {when}, so it holds whatever its registers held; "
            f"{_fix(node, buf, 'the loop' if loops else 'this line')}")


def _fix(node, buf, before: str) -> str:
    """How to give ``buf`` a value before ``node`` reads it (``before``: where the write goes)."""
    init = f"T.clear({buf.name}) or T.fill({buf.name}, value) before {before}"
    if isinstance(node, ir.Gemm) and node.C is buf:
        return f"T.gemm accumulates into it (clear_accum=False): {init}, or T.gemm(..., clear_accum=True)"
    if isinstance(node, ir.Reduce) and node.dst is buf:
        return f"T.reduce_* with clear=False combines into it: {init}, or clear=True"
    return f"write it first: {init}, or a T.copy / T.gemm into it"


def _written_later_in(loops: list, buf, reader):
    """The first statement of the enclosing loops' bodies other than ``reader`` that writes ``buf``, or None."""
    for loop in loops:
        for node in walk(loop.body):
            if node is not reader and getattr(node, "body", None) is None and buf in unit(node).writes(node):
                return node
    return None

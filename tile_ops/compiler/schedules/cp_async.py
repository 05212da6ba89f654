"""The cp.async software pipeline of ``T.Pipelined(n, num_stages=S)`` (every target, where the kernel is not
warp-specialized): the loop's global -> shared copies for iteration k + S - 1 are in flight while k computes.

    prologue: issue stages 0 .. S-2 (one commit group each)
    for k:    wait until stage k landed; barrier; issue k + S - 1; compute k
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script import builder as T

from ..cuda import emit_ptx
from ..ops.copy import copy, is_async_load
from ..ops.deferred import in_order


def pipelined(lw, node, vm, n):
    S = node.num_stages
    loads = [s for s in node.body if is_async_load(lw, s)]
    compute = [s for s in in_order(node.body) if not is_async_load(lw, s)]
    for s in range(S - 1):
        with T.If(s < n):
            with T.Then():
                for c in loads:
                    copy(lw, c, {**vm, node.var: tirx.const(s, "int32")}, stage=s, asynchronous=True)
        emit_ptx("cp.async.commit_group")
    with T.serial(0, n) as k:
        IRBuilder.name(node.var.name, k)
        emit_ptx("cp.async.wait_group", S - 2)
        lw.sync()
        nxt = k + (S - 1)
        with T.If(nxt < n):
            with T.Then():
                for c in loads:
                    copy(lw, c, {**vm, node.var: nxt}, stage=tirx.floormod(nxt, S), asynchronous=True)
        emit_ptx("cp.async.commit_group")
        lw.stage_of_iter = tirx.floormod(k, S)
        lw.body(compute, {**vm, node.var: k})
        lw.stage_of_iter = None
    emit_ptx("cp.async.wait_group", 0)
    lw.sync()

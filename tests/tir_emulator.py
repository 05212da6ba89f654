"""A tiny CPU interpreter of lowered tile_ops PrimFuncs, for elementwise kernels (no PTX calls):
every block's threads run as Python generators that meet at ``cta_sync``; global tensors and the
shared arena are numpy arrays, so vector accesses (Ramp/Broadcast) read and write real memory and
indices past a tensor's end raise.  bfloat16 is computed as float32."""

from __future__ import annotations

import operator

import numpy as np
import tvm.ir.expr as irx
import tvm.ir.prim.expr as px
from tvm.tirx import stmt as ts

_BIN = {px.Add: operator.add, px.Sub: operator.sub, px.Mul: operator.mul, px.Min: np.minimum, px.Max: np.maximum,
        px.FloorDiv: operator.floordiv, px.FloorMod: operator.mod, px.BitwiseXor: operator.xor,
        px.BitwiseAnd: operator.and_, px.BitwiseOr: operator.or_, px.LT: operator.lt, px.LE: operator.le,
        px.GT: operator.gt, px.GE: operator.ge, px.EQ: operator.eq, px.NE: operator.ne,
        px.And: np.logical_and, px.Or: np.logical_or}


def _key(var):
    return var.__chandle__()  # TVM objects compare by handle; == would build an EQ expression


def _np_dtype(dtype: str):
    return np.dtype(str(dtype).split("x")[0].replace("bfloat16", "float32"))


class Emulator:
    def __init__(self, func, arrays: dict):
        """``arrays``: parameter name -> numpy array (written in place)."""
        self.func, self.mem = func, {p.name: arrays[p.name] for p in func.params}

    def run(self, grid):
        for block in np.ndindex(*reversed(grid)):
            self.block, self.smem = tuple(reversed(block)), None
            self._run_block()

    def _run_block(self):
        seq = self.func.body.body.seq
        threads = next(int(getattr(s, "def").extents[0]) for s in seq if "thread_id" in str(s))
        gens = [self._exec(self.func.body.body, {"tid": t}) for t in range(threads)]
        while gens:  # run every thread to its next barrier
            gens = [g for g in gens if next(g, "done") != "done"]

    # ---------------------------------------------------------------- statements

    def _exec(self, s, env):
        if isinstance(s, ts.SeqStmt):
            for x in s.seq:
                yield from self._exec(x, env)
        elif isinstance(s, ts.AttrStmt):
            yield from self._exec(s.body, env)
        elif isinstance(s, ts.ScopeIdDefStmt):
            d = getattr(s, "def")
            vals = [env["tid"]] if "thread" in str(s) else self.block
            for v, x in zip(d.def_ids, vals):
                env[_key(v)] = x
        elif isinstance(s, ts.AllocBuffer):
            b = s.buffer
            if self.smem is None:  # the block's one shared arena, allocated by its first thread
                self.smem = np.zeros(int(b.shape[0]), _np_dtype(b.dtype))
        elif isinstance(s, ts.DeclBuffer):
            pass  # views are resolved at each access (_memory)
        elif isinstance(s, ts.For):
            for i in range(int(self._eval(s.min, env)), int(self._eval(s.min, env) + self._eval(s.extent, env))):
                env[_key(s.loop_var)] = i
                yield from self._exec(s.body, env)
        elif isinstance(s, ts.IfThenElse):
            if self._eval(s.condition, env):
                yield from self._exec(s.then_case, env)
            elif s.else_case is not None:
                yield from self._exec(s.else_case, env)
        elif isinstance(s, ts.BufferStore):
            mem, at = self._memory(s.buffer, s.indices, env)
            mem[at] = self._eval(s.value, env)
        elif isinstance(s, ts.Evaluate) and "cta_sync" in str(s):
            yield "sync"
        elif isinstance(s, ts.Evaluate) and ("commit_group" in str(s) or "wait_group" in str(s)):
            pass  # cp.async bookkeeping; the copies it would wait for are not emulated (they raise)
        else:
            raise NotImplementedError(f"emulator: {type(s).__name__}: {s}")

    def _memory(self, buf, indices, env):
        """(numpy array, index) of a load/store: a flat view for shared memory, n-d for parameters."""
        idx = [self._eval(i, env) for i in indices]
        name = str(buf.data).split(".")[0]
        if name in self.mem:  # a parameter
            return self.mem[name], tuple(np.asarray(i) for i in idx)
        return self.smem.view(_np_dtype(buf.dtype)), np.asarray(idx[0]) + int(buf.elem_offset)

    # ---------------------------------------------------------------- expressions

    def _eval(self, e, env):
        if isinstance(e, (int, float)):
            return e
        if isinstance(e, px.IntImm):
            return int(e.value)  # Python ints: index math is most of the work
        if isinstance(e, px.FloatImm):
            return _np_dtype(e.ty.dtype).type(e.value)
        if isinstance(e, px.Var):
            return env[_key(e)]
        if type(e) in _BIN:
            return _BIN[type(e)](self._eval(e.a, env), self._eval(e.b, env))
        if isinstance(e, px.Not):
            return np.logical_not(self._eval(e.a, env))
        if isinstance(e, px.Cast):
            return np.asarray(self._eval(e.value, env)).astype(_np_dtype(e.ty.dtype))
        if isinstance(e, px.Ramp):
            return self._eval(e.base, env) + np.arange(int(e.lanes)) * self._eval(e.stride, env)
        if isinstance(e, px.Broadcast):
            return np.full(int(e.lanes), self._eval(e.value, env))
        if isinstance(e, irx.TensorLoad):
            mem, at = self._memory(e.source, e.indices, env)
            return mem[at].copy()
        if isinstance(e, irx.Call) and "if_then_else" in str(e.op):
            c, a, b = e.args
            return self._eval(a, env) if self._eval(c, env) else self._eval(b, env)
        raise NotImplementedError(f"emulator: {type(e).__name__}: {e}")

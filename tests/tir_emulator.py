"""A tiny CPU interpreter of lowered tile_ops PrimFuncs without PTX calls (elementwise kernels, fragments
loaded by copies, reductions): every block's threads run as Python generators that meet at ``cta_sync``
and exchange warp shuffles; global tensors, the shared arena and each thread's registers (local
buffers) are numpy arrays, so vector accesses (Ramp/Broadcast) read and write real memory and indices
past a tensor's or register array's end raise.  A gemm in a loop of no iterations fixes fragment layouts
without running.  bfloat16 is computed as float32."""

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


_SHUFFLED = "shuffled"  # env: the answers of the running statement's shuffles


def _local(buf):
    """A local buffer's key in its thread's env: by name (a buffer's data var is no stable handle)."""
    return ("local", str(buf.data))


def _shuffles(e) -> list:
    """The warp shuffles in expression ``e``, innermost first."""
    if isinstance(e, irx.Call):
        inner = [c for a in e.args for c in _shuffles(a)]
        return inner + ([e] if getattr(e.op, "name", "") == "tirx.tvm_warp_shuffle_xor" else [])
    kids = [getattr(e, f) for f in ("a", "b", "value", "condition", "true_value", "false_value") if hasattr(e, f)]
    return [c for k in kids for c in _shuffles(k)]


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
        gens = {t: self._exec(self.func.body.body, {"tid": t}) for t in range(threads)}
        answers = dict.fromkeys(gens)  # what each thread's pending yield receives: a shuffle's value
        while gens:  # run every thread to its next barrier or shuffle
            at = {}
            for t, g in list(gens.items()):
                try:
                    at[t] = g.send(answers[t])
                except StopIteration:
                    del gens[t]
            answers = {t: self._shuffled(t, at) if isinstance(y, tuple) else None for t, y in at.items()}

    @staticmethod
    def _shuffled(t, at):
        """The value thread ``t``'s ``__shfl_xor_sync`` receives: its partner lane's, which must be at a shuffle
        of the same lane mask too (a converged warp)."""
        mask = at[t][2]
        partner = at.get(t // 32 * 32 + (t % 32 ^ mask))
        if not (isinstance(partner, tuple) and partner[2] == mask):
            raise NotImplementedError(f"emulator: thread {t}'s shuffle (xor {mask}) meets no partner shuffle")
        return partner[1]

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
        elif isinstance(s, ts.AllocBuffer) and s.buffer.scope() == "local":  # this thread's registers
            env[_local(s.buffer)] = np.zeros(int(np.prod([int(x) for x in s.buffer.shape])), _np_dtype(s.buffer.dtype))
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
            env[_SHUFFLED] = []  # each shuffle waits for the warp's other lanes (_run_block), in _eval's order
            for call in _shuffles(s.value):
                value, mask = self._eval(call.args[1], env), int(self._eval(call.args[2], env))
                env[_SHUFFLED].append((yield ("shfl", value, mask)))
            mem, at = self._memory(s.buffer, s.indices, env)
            mem[at] = self._eval(s.value, env)
        elif isinstance(s, ts.Evaluate) and "cta_sync" in str(s):
            yield "sync"
        elif isinstance(s, ts.Evaluate) and ("commit_group" in str(s) or "wait_group" in str(s)):
            pass  # cp.async bookkeeping; the copies it would wait for are not emulated (they raise)
        elif isinstance(s, ts.Evaluate) and ("griddepcontrol" in str(s) or "fence.proxy.async" in str(s)):
            pass  # sm_90a: launch ordering between kernels; generic-to-async proxy fences (one memory here)
        else:
            raise NotImplementedError(f"emulator: {type(s).__name__}: {s}")

    def _memory(self, buf, indices, env):
        """(numpy array, index) of a load/store: a flat view for shared memory, n-d for parameters."""
        idx = [self._eval(i, env) for i in indices]
        if _local(buf) in env:
            return env[_local(buf)], np.asarray(idx[0])
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
        if isinstance(e, irx.Call) and getattr(e.op, "name", "") == "tirx.tvm_warp_shuffle_xor":
            return env[_SHUFFLED].pop(0)  # exchanged before the statement ran (_exec)
        if isinstance(e, irx.Call) and "if_then_else" in str(e.op):
            c, a, b = e.args
            return self._eval(a, env) if self._eval(c, env) else self._eval(b, env)
        raise NotImplementedError(f"emulator: {type(e).__name__}: {e}")

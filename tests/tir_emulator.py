"""A tiny CPU interpreter of lowered tile_ops PrimFuncs: elementwise kernels, fragments, reductions and the
sm_80 tensor-core GEMM path (cp.async, ldmatrix, mma.sync m16n8k16).  Every block's threads run as Python
generators that stop at ``cta_sync`` and at warp-wide instructions (shuffles, ldmatrix, mma.sync); the
scheduler answers a warp instruction once all 32 lanes of the warp are at it and releases the barrier once
every thread is at it, and raises where neither can happen (divergent warps or barriers).

Global tensors, the block's shared arena (bytes) and each thread's registers (local buffers) are numpy
arrays, so vector accesses (Ramp/Broadcast) read and write real memory and indices past a tensor's or
register array's end raise.  The shared arena starts as 0xFF bytes, NaN in every float type, so reading
shared memory that nothing wrote shows in the result.  bfloat16 is stored as its bits (pass bfloat16
tensors as uint16 arrays) and computed as float32, rounded to nearest even where stored or cast.  A gemm in
a loop of no iterations fixes fragment layouts without running."""

from __future__ import annotations

import operator
from collections import Counter

import numpy as np
import tvm.ir.expr as irx
import tvm.ir.prim.expr as px
from tvm.tirx import stmt as ts

_BIN = {px.Add: operator.add, px.Sub: operator.sub, px.Mul: operator.mul, px.Min: np.minimum, px.Max: np.maximum,
        px.FloorDiv: operator.floordiv, px.FloorMod: operator.mod, px.BitwiseXor: operator.xor,
        px.BitwiseAnd: operator.and_, px.BitwiseOr: operator.or_, px.LT: operator.lt, px.LE: operator.le,
        px.GT: operator.gt, px.GE: operator.ge, px.EQ: operator.eq, px.NE: operator.ne,
        px.And: np.logical_and, px.Or: np.logical_or}

_CP_ASYNC = {"tirx.ptx.cp_async_ca", "tirx.ptx.cp_async_cg", "tirx.ptx.cp_async_ca_src_size",
             "tirx.ptx.cp_async_cg_src_size"}
_NO_OPS = {"tirx.ptx.cp_async_commit_group", "tirx.ptx.cp_async_wait_group",  # copies complete at issue here
           "tirx.ptx.griddepcontrol",  # sm_90a: launch ordering between kernels
           "tirx.ptx.fence_proxy"}  # generic-to-async proxy fences: one memory here
_SHUFFLED = "shuffled"  # env: the answers of the running statement's shuffles


def _key(var):
    return var.__chandle__()  # TVM objects compare by handle; == would build an EQ expression


def _op(e) -> str:
    """The name of the intrinsic ``e`` calls ("" if it is no call)."""
    return getattr(getattr(e, "op", None), "name", "") if isinstance(e, irx.Call) else ""


def _shuffles(e) -> list:
    """The warp shuffles in expression ``e``, innermost first."""
    if isinstance(e, irx.Call):
        inner = [c for a in e.args for c in _shuffles(a)]
        return inner + ([e] if _op(e) == "tirx.tvm_warp_shuffle_xor" else [])
    kids = [getattr(e, f) for f in ("a", "b", "value", "condition", "true_value", "false_value") if hasattr(e, f)]
    return [c for k in kids for c in _shuffles(k)]


def _operands(call):
    """A PTX call's expression operands and its string modifiers."""
    exprs = [a for a in call.args if not isinstance(a, irx.StringImm)]
    return exprs, [a.value for a in call.args if isinstance(a, irx.StringImm)]


# ---------------------------------------------------------------- dtypes


def _is_bf16(dtype) -> bool:
    return str(dtype).split("x")[0] == "bfloat16"


def _storage(dtype):
    """The numpy dtype memory holds ``dtype`` (or its vectors) in: bfloat16 as its bits."""
    return np.dtype(np.uint16) if _is_bf16(dtype) else np.dtype(str(dtype).split("x")[0])


def _values(dtype):
    """The numpy dtype ``dtype``'s values are computed in: bfloat16 as float32."""
    return np.dtype(np.float32) if _is_bf16(dtype) else _storage(dtype)


def _bf16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even; NaN stays a (quiet) NaN."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(x), 0x7FC0, rounded).astype(np.uint16)


def _bf16_values(bits):
    """bfloat16 bits -> their float32 values."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def _halves(words, ab: str):
    """The 16-bit elements packed in b32 registers ``words`` (lanes x registers), each register's low half
    first, as float64: (lanes, 2 x registers)."""
    h = np.ascontiguousarray(words, np.uint32).view(np.uint16)
    return (_bf16_values(h) if ab == "bf16" else h.view(np.float16)).astype(np.float64)


def _span(mem, offset: int, n: int):
    """``n`` bytes of byte array ``mem`` from ``offset``; raises past either end."""
    if offset < 0 or offset + n > mem.size:
        raise IndexError(f"emulator: bytes [{offset}, {offset + n}) outside a {mem.size}-byte memory")
    return mem[offset:offset + n]


# ---------------------------------------------------------------- warp instructions (all 32 lanes at once)


def _shfl(emu, mask, values):
    """``__shfl_xor_sync``: lane i receives lane (i ^ mask)'s value."""
    return [values[i ^ mask] for i in range(32)]


def _ldmatrix(emu, key, addrs):
    """``ldmatrix.sync.aligned.m8n8.x{count}[.trans].shared.b16``: lanes 8i..8i+7 give the shared addresses
    (16-byte aligned) of the 8 rows of 8 b16 elements of matrix i; lane t receives, for each matrix, the b32
    word of its row t/4, elements 2(t%4) (low half) and 2(t%4)+1; with .trans, of the transposed matrix."""
    count, trans = key
    rows = []
    for a in addrs[:8 * count]:
        if a % 16:
            raise ValueError(f"emulator: ldmatrix row address {a} is not 16-byte aligned")
        rows.append(_span(emu.smem, a, 16).view(np.uint16))
    mats = np.stack(rows).reshape(count, 8, 8)
    if trans:
        mats = mats.transpose(0, 2, 1)
    words = np.ascontiguousarray(mats).view(np.uint32).reshape(count, 32)
    return [words[:, t] for t in range(32)]


def _mma(emu, ab, operands):
    """``mma.sync.aligned.m16n8k16.row.col.f32.{ab}.{ab}.f32`` D = A B + C, A 16x16 (row), B 16x8 (col),
    with g = lane/4, c = 2(lane%4): A's registers a0..a3 hold A[g, c:c+2], A[g+8, c:c+2], A[g, c+8:c+10],
    A[g+8, c+8:c+10]; B's b0, b1 hold B[c:c+2, g], B[c+8:c+10, g]; C's and D's four floats C[g, c:c+2],
    C[g+8, c:c+2].  Products are exact and summed in float64, then rounded to float32."""
    a, b, c = (np.array([op[i] for op in operands]) for i in range(3))
    A = _halves(a, ab).reshape(8, 4, 2, 2, 2).transpose(3, 0, 2, 1, 4).reshape(16, 16)  # [g, t, col, row, h]
    B = _halves(b, ab).reshape(8, 4, 2, 2).transpose(2, 1, 3, 0).reshape(16, 8)  # [g, t, k half, h]
    C = c.astype(np.float64).reshape(8, 4, 2, 2).transpose(2, 0, 1, 3).reshape(16, 8)  # [g, t, row half, h]
    D = (A @ B + C).astype(np.float32)
    return list(D.reshape(2, 8, 4, 2).transpose(1, 2, 0, 3).reshape(32, 4))


_WARP = {"shfl": _shfl, "ldmatrix": _ldmatrix, "mma": _mma}


class Emulator:
    def __init__(self, func, arrays: dict):
        """``arrays``: parameter name -> numpy array (written in place; bfloat16 ones as uint16 bits)."""
        self.func, self.mem = func, {p.name: arrays[p.name] for p in func.params}
        self.names = {}  # buffer handle -> its data var's name
        self.ran = Counter()  # PTX instructions executed, by lane: "cp.async.cg.16", "ldmatrix.x4.trans", ...
        for p in func.params:
            if _is_bf16(p.dtype) and self.mem[p.name].dtype != np.uint16:
                raise TypeError(f"emulator: pass bfloat16 tensor {p.name} as a uint16 array of its bits")

    def run(self, grid):
        for block in np.ndindex(*reversed(grid)):
            self.block, self.smem = tuple(reversed(block)), None
            self._run_block()

    def _run_block(self):
        body = self.func.body.body
        threads = next(int(getattr(s, "def").extents[0]) for s in body.seq
                       if isinstance(s, ts.ScopeIdDefStmt) and "thread_id" in str(s))
        gens = {t: self._exec(body, {"tid": t}) for t in range(threads)}
        at = dict.fromkeys(gens)  # where each thread waits: "sync", a warp instruction ("kind", key, operand)
        go = dict.fromkeys(gens)  # the threads to resume, with what their yield receives
        while gens:
            for t, answer in go.items():
                try:
                    at[t] = gens[t].send(answer)
                except StopIteration:
                    del gens[t], at[t]
            go = self._resumable(at)

    def _resumable(self, at) -> dict:
        """The waiting threads that go on, with their answers: the warps all of whose lanes are at one warp
        instruction get its results; when none is, and every thread is at the barrier, all go on."""
        go = {}
        for w in sorted({t // 32 for t, y in at.items() if isinstance(y, tuple)}):
            lanes = [at.get(w * 32 + i) for i in range(32)]
            if all(isinstance(y, tuple) for y in lanes):
                instrs = {y[:2] for y in lanes}
                if len(instrs) > 1:
                    raise NotImplementedError(f"emulator: block {self.block} warp {w}'s lanes are at different "
                                              f"warp instructions: {sorted(map(str, instrs))}")
                kind, key = instrs.pop()
                go.update(zip(range(w * 32, w * 32 + 32), _WARP[kind](self, key, [y[2] for y in lanes])))
        if go or not at:
            return go
        if all(y == "sync" for y in at.values()):
            return dict.fromkeys(at)
        waits = sorted({y if y == "sync" else y[0] for y in at.values()})
        raise RuntimeError(f"emulator: block {self.block} deadlocks: its {len(at)} threads wait at {waits} "
                           f"(a warp instruction some lanes skip, or a barrier not every thread reaches)")

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
            env[self._local(s.buffer)] = np.zeros(int(np.prod([int(x) for x in s.buffer.shape])), _storage(s.buffer.dtype))
        elif isinstance(s, ts.AllocBuffer):
            b = s.buffer
            if self.smem is None:  # the block's one shared arena, allocated by its first thread; bytes
                self.smem = np.full(int(b.shape[0]) * _storage(b.dtype).itemsize, 0xFF, np.uint8)
        elif isinstance(s, ts.DeclBuffer) and ("local", str(s.data)) in env:  # a view of registers (as uint32:
            self.names[_key(s.buffer)] = str(s.data)  # a register A operand) reads and writes those registers
        elif isinstance(s, ts.DeclBuffer):
            pass  # views of shared memory and parameters are resolved at each access (_memory)
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
                env[_SHUFFLED].append((yield ("shfl", mask, value)))
            self._store(s.buffer, s.indices, self._eval(s.value, env), env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.cuda.cta_sync":
            yield "sync"
        elif isinstance(s, ts.Evaluate) and _op(s.value) in _CP_ASYNC:
            self._cp_async(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.ldmatrix":
            yield from self._issue_ldmatrix(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) == "tirx.ptx.mma":
            yield from self._issue_mma(s.value, env)
        elif isinstance(s, ts.Evaluate) and _op(s.value) in _NO_OPS:
            pass
        else:
            raise NotImplementedError(f"emulator: {type(s).__name__}: {s}")

    def _cp_async(self, call, env):
        """``cp.async.{ca,cg}.shared.global [dst], [src], cp_size[, src_size]``: copies ``cp_size`` bytes (4, 8 or
        16; 16 for .cg) from global to shared memory, both addresses aligned to it; the bytes from ``src_size``
        on are zero-filled (and not read).  Done at issue: commit_group/wait_group have nothing to wait for."""
        (dst, src, cp_size, *src_size), _ = _operands(call)
        n = int(self._eval(cp_size, env))
        m = int(self._eval(src_size[0], env)) if src_size else n
        (shared, d), (glob, g) = self._address(dst, env, "shared"), self._address(src, env, "global")
        if n not in (4, 8, 16) or ("cg" in _op(call) and n != 16) or not 0 <= m <= n or d % n or g % n:
            raise ValueError(f"emulator: {_op(call)} of {n} bytes ({m} read) from byte {g} to shared byte {d}")
        _span(shared, d, n)[:] = 0
        _span(shared, d, m)[:] = _span(glob, g, m)
        self.ran[f"cp.async.{'cg' if 'cg' in _op(call) else 'ca'}.{n}" + (" zero-filled" if m < n else "")] += 1

    def _issue_ldmatrix(self, call, env):
        """This lane's part of an ldmatrix (see _ldmatrix): its row address out, its words into the registers."""
        (*regs, ptr), mods = _operands(call)
        if mods[:4] != ["sync", "aligned", "m8n8", f"x{len(regs)}"] or mods[5:7] != ["shared", "b16"]:
            raise NotImplementedError(f"emulator: ldmatrix{'.'.join(mods)}")
        _, addr = self._address(ptr, env, "shared")
        self.ran[f"ldmatrix.x{len(regs)}" + (".trans" if mods[4] == "trans" else "")] += 1
        words = yield ("ldmatrix", (len(regs), mods[4] == "trans"), addr)
        for r, w in zip(regs, words):
            self._store(r.source, r.indices, w, env)

    def _issue_mma(self, call, env):
        """This lane's part of an mma.sync (see _mma): registers D (4 f32), A (4 b32), B (2 b32), C (4 f32)."""
        regs, mods = _operands(call)
        ab = mods[6]
        if mods[:9] != ["sync", "aligned", "m16n8k16", "row", "col", "f32", ab, ab, "f32"] or ab not in ("f16", "bf16"):
            raise NotImplementedError(f"emulator: mma.{'.'.join(mods)}")
        a, b, c = ([self._eval(r, env) for r in regs[i:j]] for i, j in ((4, 8), (8, 10), (10, 14)))
        self.ran[f"mma.{ab}"] += 1
        d = yield ("mma", ab, (a, b, c))
        for r, v in zip(regs[:4], d):
            self._store(r.source, r.indices, v, env)

    # ---------------------------------------------------------------- memory

    def _name(self, buf) -> str:
        """The name of ``buf``'s data var (a buffer's data var is no stable handle; printing it is slow)."""
        h = _key(buf)
        if h not in self.names:
            self.names[h] = str(buf.data)
        return self.names[h]

    def _local(self, buf):
        """A local buffer's key in its thread's env."""
        return ("local", self._name(buf))

    def _param(self, buf) -> str:
        return self._name(buf).split(".")[0]

    def _memory(self, buf, indices, env):
        """(numpy array, index) of a load/store: flat for registers (a register array viewed as ``buf``'s
        dtype, e.g. a fragment's halves as b32 words) and shared memory, n-d for parameters."""
        idx = [self._eval(i, env) for i in indices]
        if self._local(buf) in env:
            return env[self._local(buf)].view(_storage(buf.dtype)), np.asarray(idx[0])
        if self._param(buf) in self.mem:
            return self.mem[self._param(buf)], tuple(np.asarray(i) for i in idx)
        return self.smem.view(_storage(buf.dtype)), np.asarray(idx[0]) + int(buf.elem_offset)

    def _load(self, buf, indices, env):
        mem, at = self._memory(buf, indices, env)
        return _bf16_values(mem[at]) if _is_bf16(buf.dtype) else mem[at].copy()

    def _store(self, buf, indices, value, env):
        mem, at = self._memory(buf, indices, env)
        mem[at] = _bf16_bits(value) if _is_bf16(buf.dtype) else value

    def _address(self, ptr, env, space: str):
        """(byte array, byte offset) a pointer operand points to: ``address_of(buf[i])`` in a global tensor, or
        ``cvta_generic_to_shared(address_of(buf[i]))`` in the shared arena; ``space`` is the one expected."""
        shared = _op(ptr) == "tirx.cuda.cvta_generic_to_shared"
        load = ptr.args[0].args[0] if shared else ptr.args[0]
        if _op(ptr.args[0] if shared else ptr) != "tirx.address_of" or space != ("shared" if shared else "global"):
            raise NotImplementedError(f"emulator: a {space} address: {ptr}")
        buf, idx = load.source, [int(self._eval(i, env)) for i in load.indices]
        size = _storage(buf.dtype).itemsize
        if shared:
            return self.smem, (idx[0] + int(buf.elem_offset)) * size
        tensor = self.mem[self._param(buf)]
        return tensor.reshape(-1).view(np.uint8), int(np.ravel_multi_index(idx, tensor.shape)) * size

    # ---------------------------------------------------------------- expressions

    def _eval(self, e, env):
        if type(e) in _BIN:  # the common cases first: index math is most of the work
            return _BIN[type(e)](self._eval(e.a, env), self._eval(e.b, env))
        if isinstance(e, px.Var):
            return env[_key(e)]
        if isinstance(e, px.IntImm):
            return int(e.value)  # Python ints
        if isinstance(e, (int, float)):
            return e
        if isinstance(e, px.FloatImm):
            return _values(e.ty.dtype).type(e.value)
        if isinstance(e, px.Not):
            return np.logical_not(self._eval(e.a, env))
        if isinstance(e, px.Cast):
            v = np.asarray(self._eval(e.value, env)).astype(_values(e.ty.dtype))
            return _bf16_values(_bf16_bits(v)) if _is_bf16(e.ty.dtype) else v
        if isinstance(e, px.Ramp):
            return self._eval(e.base, env) + np.arange(int(e.lanes)) * self._eval(e.stride, env)
        if isinstance(e, px.Broadcast):
            return np.full(int(e.lanes), self._eval(e.value, env))
        if isinstance(e, irx.TensorLoad):
            return self._load(e.source, e.indices, env)
        if _op(e) == "tirx.tvm_warp_shuffle_xor":
            return env[_SHUFFLED].pop(0)  # exchanged before the statement ran (_exec)
        if _op(e).endswith(".if_then_else"):
            c, a, b = e.args
            return self._eval(a, env) if self._eval(c, env) else self._eval(b, env)
        if isinstance(e, px.Div):
            return np.true_divide(self._eval(e.a, env), self._eval(e.b, env))
        if _op(e) == "tirx.cuda.func_call" and e.args[0].value == "tile_ops_exp2":  # ex2.approx.ftz: exact
            y = np.exp2(np.asarray(self._eval(e.args[1], env), np.float32))  # here; under 2^-126 flushed to 0
            return np.where(y < np.float32(2.0 ** -126), np.float32(0), y)
        raise NotImplementedError(f"emulator: {type(e).__name__}: {e}")

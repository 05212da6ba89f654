"""tile_ops.jit — specialize, compile, cache and launch tile programs.

``@tile_ops.jit(out_idx=[2])`` wraps a factory whose Python arguments are compile-time
constants and which returns a ``@T.prim_func``.  Calling the factory returns a launchable
:class:`Kernel`; kernels are cached in memory and on disk per (program source, arguments,
target arch, tile_ops compiler fingerprint, pinned TVM version).  A disk hit neither traces
the program nor imports TVM.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import os
import re
import textwrap
import threading
import time
import warnings

from . import interpret
from .kernel import Kernel, KernelMeta

TVM_VERSION = "0.27.0.post1"  # the apache-tvm release the compiler is written against (setup.py pins it)
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FINGERPRINTED = ("lang", "compiler", "kernels", os.path.join("jit", "build.py"))  # under tile_ops/


@functools.lru_cache(maxsize=None)
def compiler_fingerprint() -> str:
    """Hash of the language, compiler and kernel-library sources and of the nvcc build step: a change to any
    invalidates cached kernels (a library factory's key has its own source, not that of the helpers it calls)."""
    from .. import __version__

    h = hashlib.sha256(f"{__version__}|tvm={TVM_VERSION}".encode())
    for sub in FINGERPRINTED:
        path = os.path.join(_PKG, sub)
        files = [path] if sub.endswith(".py") else sorted(
            os.path.join(d, f) for d, _, names in os.walk(path) for f in names if f.endswith(".py"))
        for fname in files:
            with open(fname, "rb") as f:
                h.update(os.path.relpath(fname, _PKG).encode() + f.read())
    return h.hexdigest()[:16]


def default_arch(device=None) -> str:
    """The arch of ``device`` (default: the current GPU; sm_90a on Hopper), or sm_90a when there is no GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(device)
            return f"sm_{major}{minor}" + ("a" if major == 9 else "")
    except ImportError:
        pass
    return "sm_90a"


def build_target(arch: str):
    """The GPU to compile for: ``arch``, with the SM count of the current GPU where it is of that arch (the
    schedules size persistent grids and waves by it), else the arch's table.  A kernel built in a process is
    kept for that arch, so a second GPU of the same arch but another SM count reuses the first one's."""
    from ..compiler.targets import Target

    sms = None
    try:
        import torch

        if torch.cuda.is_available() and default_arch() == arch:
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    except Exception:  # noqa: BLE001 - no usable GPU (a CPU build of torch, a test's stand-in): the table's
        pass
    return Target.of(arch, sms)


@functools.lru_cache(maxsize=None)
def check_arch(arch: str) -> str:
    """``arch`` if the compiler can target it (sm_80 and newer; sm_90a for the Hopper path), else ValueError."""
    m = re.fullmatch(r"sm_(\d+)(a?)", str(arch))
    # the arch-specific 'a' target: the compiler has a path for Hopper's only (nvcc has none before sm_90)
    if not m or int(m.group(1)) < 80 or (m.group(2) and m.group(1) != "90"):
        raise ValueError(f"tile_ops: target arch {arch!r} is not one the compiler builds for (accepted: sm_80 or "
                         f"newer, e.g. sm_80, sm_86, sm_89, sm_90; sm_90a for Hopper's TMA + wgmma path, the only "
                         f"'a' target)")
    return arch


def _names_read(code) -> set:
    """The global names ``code`` and the functions nested in it read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names_read(const)
    return names


def _stable(v, name: str = "the value"):
    """``v`` as the key sees it, the same in every process: data as itself (containers element by element,
    sets sorted), a function (or factory) by its name and source, a partial by its function and arguments,
    another object by its text.  An object whose text is an address has no such identity: TypeError, naming
    it as ``name``."""
    if isinstance(v, JITFunction):
        v = v.fn
    if inspect.isfunction(v):
        return _function_identity(v)
    if isinstance(v, functools.partial):
        return ["functools.partial", _stable(v.func, name), _stable(v.args, name), _stable(v.keywords, name)]
    if isinstance(v, (list, tuple)):
        return [_stable(x, name) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_stable(x, name) for x in v), key=json.dumps)
    if isinstance(v, dict):
        return sorted(([_stable(k, name), _stable(x, name)] for k, x in v.items()), key=json.dumps)
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    text = str(v)  # dtypes and the like
    if " at 0x" in text:  # keyed by its type, two such values would share a kernel
        raise TypeError(f"tile_ops.jit: {name} is {text}, which cannot key a kernel: its text is a memory address "
                        f"(accepted: numbers, strings, None, lists, tuples, sets and dicts of them, functions (by "
                        f"qualified name and source), functools.partial of those, and objects whose repr says what "
                        f"they are: give its class a __repr__, or pass what the factory needs from it)")
    return text


@functools.lru_cache(maxsize=4096)
def _function_identity(v) -> str:
    """A function's name and source hash (read once a process: inspect.getsource took ms of every key)."""
    try:
        return f"{v.__module__}.{v.__qualname__}:{hashlib.sha256(inspect.getsource(v).encode()).hexdigest()}"
    except (OSError, TypeError):
        return f"{v.__module__}.{v.__qualname__}"


_EMPTY = object()  # a closure cell not assigned yet


def _cell(c):
    try:
        return c.cell_contents
    except ValueError:
        return _EMPTY


def _types(values) -> tuple:
    """The values' types, a tuple's item by item: (1,) == (1.0,) and hash alike too (a list is unhashable)."""
    return tuple(_types(v) if type(v) is tuple else type(v) for v in values)


class JITFunction:
    def __init__(self, fn, out_idx, target):
        self.fn, self.target = fn, target
        self.out_idx = [out_idx] if isinstance(out_idx, int) else list(out_idx or [])
        self._mem: dict = {}  # full key -> Kernel
        self._fast: dict = {}  # (args, kwargs, arch, environment, types) -> Kernel: the per-call path skips hashing
        self._source = textwrap.dedent(inspect.getsource(fn))
        self._read = _names_read(fn.__code__)  # global names (or attributes) it may read
        self._globals = None  # those that are module globals and not modules (the language): set at first use
        functools.update_wrapper(self, fn)

    def environment(self) -> tuple:
        """The current values of the module globals (not modules) and closure cells the factory reads, in the
        order of :meth:`environment_names`: they shape its program as much as its arguments do (a module's
        BLOCK = 64, a notebook's closure).  A few dict lookups: it is part of every call's fast key."""
        g = self.fn.__globals__
        if self._globals is None:
            self._globals = sorted(n for n in self._read if n in g and not inspect.ismodule(g[n]))
        cells = self.fn.__closure__
        return tuple(g.get(n) for n in self._globals) + (tuple(map(_cell, cells)) if cells else ())

    def environment_names(self) -> list:
        self.environment()
        return self._globals + list(self.fn.__code__.co_freevars)

    def key(self, args, kwargs, arch) -> str:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        fn = self.fn.__qualname__
        env = [[n, _stable(v, f"{n}, which {fn} reads,")]
               for n, v in zip(self.environment_names(), self.environment()) if v is not _EMPTY]
        args = {n: _stable(v, f"the argument {n} of {fn}") for n, v in bound.arguments.items()}
        blob = json.dumps({
            "fn": f"{self.fn.__module__}.{fn}", "src": self._source,
            "args": args, "out_idx": self.out_idx, "arch": arch, "sms": build_target(arch).sms, "env": env,
            "compiler": compiler_fingerprint(),
        }, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def __call__(self, *args, target: str | None = None, **kwargs) -> Kernel:
        arch = check_arch(target) if target else self.target or default_arch()
        env = self.environment()  # with the types: 1 == 1.0 == True, but the full key (and the program) differ
        interpreted = interpret.enabled()  # TILE_OPS_INTERPRET: the emulator's kernel, nothing compiled
        fast = (args, tuple(sorted(kwargs.items())), arch, env, _types(args), _types(kwargs.values()), _types(env),
                interpreted)
        try:
            kernel = self._fast.get(fast)
        except TypeError:  # unhashable arguments: always take the full key
            kernel, fast = None, None
        if kernel is None:
            key = self.key(args, kwargs, arch) + ("-interpreted" if interpreted else "")
            kernel = self._mem.get(key)
            if kernel is None and interpreted:
                kernel = self._mem[key] = interpret.Interpreted(self.fn(*args, **kwargs), arch, self.out_idx)
            elif kernel is None:
                kernel = self._mem[key] = _load_or_build(key, lambda: self.fn(*args, **kwargs), build_target(arch),
                                                         self.out_idx)
            if fast is not None:
                self._fast[fast] = kernel
        return kernel


def jit(fn=None, *, out_idx=None, target: str | None = None):
    """Decorator: ``@tile_ops.jit(out_idx=[2])`` on a factory returning a ``@T.prim_func``."""
    if target:
        check_arch(target)
    if fn is None:
        return lambda f: JITFunction(f, out_idx, target)
    return JITFunction(fn, out_idx, target)


def compile(prog, out_idx=None, target: str | None = None) -> Kernel:  # noqa: A001
    """Compile a traced program (a ``@T.prim_func``) directly, bypassing the disk cache."""
    arch = check_arch(target) if target else default_arch()
    return _build(prog, build_target(arch), [out_idx] if isinstance(out_idx, int) else list(out_idx or []))[0]


_compiling = threading.local()  # .keys: the set compiled_keys() collects into for this thread, if any


@contextlib.contextmanager
def compiled_keys():
    """Collects the cache keys whose kernels this thread compiles inside the block: not those it loads (from memory,
    or from the disk cache, where another process may have put one while this one waited for its lock).  What
    `precompile` reports as built."""
    outer = getattr(_compiling, "keys", None)
    _compiling.keys = keys = set()
    try:
        yield keys
    finally:
        _compiling.keys = outer
        if outer is not None:
            outer |= keys


def _load_or_build(key, trace, target, out_idx) -> Kernel:
    from .cache import CacheEntry, DiskCache

    cache = DiskCache()
    entry = cache.load(key)
    if entry is None:
        with cache.lock(key):
            entry = cache.load(key)  # another process may have built it while we waited
            if entry is None:
                t0 = time.perf_counter()
                prog = trace()
                trace_s = time.perf_counter() - t0
                kernel, stats = _build(prog, target, out_idx)
                if getattr(_compiling, "keys", None) is not None:
                    _compiling.keys.add(key)
                stats = {"trace_s": round(trace_s, 3), **stats}
                cache.store(key, CacheEntry(kernel.source, kernel.cubin, {**kernel.meta.to_json(), **stats}))
                return kernel
    try:
        meta = KernelMeta.from_json({k: v for k, v in entry.meta.items() if k in KernelMeta.__dataclass_fields__})
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # damaged, or written before a field existed
        cache.discard(key, f"its kernel description does not load: {type(e).__name__}: {e}")
        return _load_or_build(key, trace, target, out_idx)
    return Kernel(meta, entry.source, entry.cubin)


def _build(prog, target, out_idx):
    from ..compiler import compile_program
    from .build import build_cubin, check_accumulator_order, nvcc_version

    t0 = time.perf_counter()
    c = compile_program(prog, target.arch, target.sms)
    t1 = time.perf_counter()
    cubin, resources = build_cubin(c.source, target.arch, c.meta.entry)
    t2 = time.perf_counter()
    if "wgmma.mma_async" in c.source:  # ptxas has moved accumulator reads above their wait once
        check_accumulator_order(cubin, prog.name)
    t3 = time.perf_counter()
    meta = c.meta.replace(out_idx=out_idx, resources=resources)
    stats = {"lower_s": round(t1 - t0, 3), "codegen_s": round(c.codegen_s, 3), "nvcc_s": round(t2 - t1, 3),
             "check_s": round(t3 - t2, 3), "nvcc": nvcc_version()}
    spilled, frame = resources.get("spill_stores", 0), resources.get("stack_frame", 0)
    if spilled or frame > 1024:  # local memory in the main loop: correct, and slow
        warnings.warn(f"tile_ops: kernel {prog.name} ({target.arch}, grid {c.meta.grid}, {c.meta.block[0]} threads) "
                      f"keeps {max(spilled, frame)} bytes per thread in local memory (ptxas: {spilled} bytes spilled, "
                      f"{frame} bytes of stack): expect it to be slow; smaller tiles per thread (block sizes, or more "
                      f"threads) fit the registers", stacklevel=2)
    kernel = Kernel(meta, c.source, cubin)
    kernel.tir = c.tir
    return kernel, stats

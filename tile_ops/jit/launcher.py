"""Kernel launcher: loads cubins and launches them through the ``tile_ops._C`` extension.

``tile_ops._C`` is built from ``csrc/`` (launcher.cpp: the driver; plans.cpp: the ops' plans,
against libtorch) by ``setup.py``; if it is missing (the build failed at install time, or the
installed copy is stale) :func:`get_launcher` JIT-builds the same sources once per process with
``torch.utils.cpp_extension.load`` into ``<cache_dir()>/build/launcher-<python>-<torch>/``.
"""

from __future__ import annotations

import pathlib
import sys
import threading
from types import ModuleType
from typing import Sequence

from .cache import cache_dir

__all__ = ["get_launcher", "launcher_sources", "CudaFunction"]

# Must match kApiVersion in csrc/launcher.cpp; an extension reporting another version is stale.
API_VERSION = 8
SOURCES = ("launcher.cpp", "plans.cpp")

_launcher: ModuleType | None = None
_lock = threading.Lock()


def launcher_sources() -> list[pathlib.Path]:
    """The extension's sources: in ``<repo>/csrc`` in a checkout, ``tile_ops/_csrc`` in a wheel."""
    pkg = pathlib.Path(__file__).resolve().parents[1]
    candidates = [pkg.parent / "csrc", pkg / "_csrc"]
    for c in candidates:
        if all((c / name).is_file() for name in SOURCES):
            return [c / name for name in SOURCES]
    raise RuntimeError(
        f"tile_ops: cannot find the launcher sources {', '.join(SOURCES)} (looked in "
        + ", ".join(str(c) for c in candidates) + "); reinstall tile_ops")


def build_directory() -> pathlib.Path:
    import torch

    tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}".replace("+", "_")
    return cache_dir() / "build" / f"launcher-{tag}"


def _jit_build() -> ModuleType:
    from torch.utils import cpp_extension

    build_dir = build_directory()
    build_dir.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(
        name="tile_ops_C",
        sources=[str(s) for s in launcher_sources()],
        extra_cflags=["-O3"],
        extra_ldflags=["-ldl"],
        build_directory=str(build_dir),
        with_cuda=False,
        verbose=False,
    )


def get_launcher() -> ModuleType:
    """The launcher extension module (``tile_ops._C``, or a JIT-built copy); cached per process."""
    global _launcher
    if _launcher is not None:
        return _launcher
    with _lock:
        if _launcher is not None:
            return _launcher
        try:
            from tile_ops import _C as mod

            if getattr(mod, "API_VERSION", None) != API_VERSION:
                raise ImportError(f"tile_ops._C at {mod.__file__} is stale "
                                  f"(API_VERSION {getattr(mod, 'API_VERSION', None)}, want {API_VERSION})")
        except ImportError as import_error:
            try:
                mod = _jit_build()
            except Exception as e:
                raise RuntimeError(
                    f"tile_ops: the launcher extension tile_ops._C is not available ({import_error}) "
                    f"and JIT-building it from csrc/ failed: {e}. It needs a C++17 compiler, "
                    "ninja and torch's headers; reinstall with `pip install --no-build-isolation --no-deps -e .` "
                    "to see the build log") from e
            if getattr(mod, "API_VERSION", None) != API_VERSION:  # a launcher.cpp from another release
                raise RuntimeError(f"tile_ops: the launcher JIT-built from {launcher_sources()[0].parent} has API_VERSION "
                                   f"{getattr(mod, 'API_VERSION', None)}, want {API_VERSION}; reinstall tile_ops")
        _launcher = mod
        return mod


class CudaFunction:
    """One kernel of a cubin, loaded lazily on each device it is launched on.

    Each kernel argument is an int (a 64-bit value: a device pointer) or ``bytes`` passed by value
    (a TMA descriptor from ``encode_tensor_map``); ``smem_bytes`` is the dynamic shared memory
    per block (the >48 KiB opt-in is set when the function is loaded).  ``programmatic``: launched with
    programmatic stream serialization, for a kernel that waits for its predecessor itself
    (``griddepcontrol.wait``: ``KernelMeta.waits_at_entry``; ``Kernel.dependent``).  Each CudaFunction loads
    its own module, so the same cubin can be loaded both ways.
    """

    __slots__ = ("cubin", "name", "smem_bytes", "programmatic", "_per_device", "_launch")

    def __init__(self, cubin: bytes, name: str, smem_bytes: int = 0, programmatic: bool = False):
        self.cubin = bytes(cubin)
        self.name = name
        self.smem_bytes = int(smem_bytes)
        self.programmatic = bool(programmatic)
        self._per_device: dict[int, tuple[int, int]] = {}  # device -> (module, function)
        self._launch = None

    def _load(self, device: int) -> int:
        lib = get_launcher()
        module = lib.load_module(self.cubin, device)
        try:
            function = lib.get_function(module, self.name, self.smem_bytes, self.programmatic)
        except BaseException:
            lib.unload_module(module)
            raise
        self._per_device[device] = (module, function)
        self._launch = lib.launch
        return function

    def bind(self, device: int):
        """``(launch, handle)`` for callers that launch often: ``launch(handle, grid, block, smem_bytes,
        stream, args, name)`` is the extension's launch, with the function loaded on ``device``."""
        entry = self._per_device.get(device)
        function = entry[1] if entry is not None else self._load(device)
        return self._launch, function

    def launch(self, grid: Sequence[int], block: Sequence[int], args: Sequence[int | bytes],
               stream: int, device: int) -> None:
        launch, function = self.bind(device)
        launch(function, grid, block, self.smem_bytes, stream, args, self.name)

    def max_active_clusters(self, device: int, cluster: int, block_threads: int) -> int:
        """Clusters of this persistent kernel (a 1-D grid, __cluster_dims__(cluster, 1, 1)) resident at once on
        ``device``; -1 if the driver cannot say."""
        _, function = self.bind(device)
        return get_launcher().max_active_clusters(function, cluster, block_threads, self.smem_bytes)

    def unload(self) -> None:
        """Unload the cubin from every device it was loaded on (it reloads on the next launch)."""
        lib = get_launcher() if self._per_device else None
        while self._per_device:
            _, (module, _) = self._per_device.popitem()
            lib.unload_module(module)

    def __repr__(self) -> str:
        return (f"CudaFunction({self.name!r}, cubin={len(self.cubin)} bytes, "
                f"smem={self.smem_bytes}, devices={sorted(self._per_device)})")

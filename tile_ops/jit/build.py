"""CUDA source -> cubin with nvcc, and cubin -> SASS with cuobjdump (no GPU needed for either)."""

from __future__ import annotations

import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time


def _find_tool(name: str, env: str) -> str | None:
    if os.environ.get(env):
        path = os.environ[env]
        return os.path.join(path, name) if os.path.isdir(path) else path
    found = shutil.which(name)
    if found:
        return found
    candidates = [f"/usr/local/cuda/bin/{name}"]
    for site in sys.path:  # wheels that bundle the tool: nvidia-cuda-cuobjdump, triton
        candidates += glob.glob(os.path.join(site, "nvidia", "cu*", "bin", name))
        candidates += glob.glob(os.path.join(site, "triton", "backends", "nvidia", "bin", name))
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), None)


def nvcc_path() -> str:
    path = _find_tool("nvcc", "TILE_OPS_NVCC")
    if path is None:
        raise RuntimeError("tile_ops: nvcc was not found (set TILE_OPS_NVCC or put the CUDA toolkit's bin on PATH); "
                           "it is needed to build cubins. Cached kernels load without it.")
    return path


@functools.lru_cache(maxsize=None)
def nvcc_version() -> str:
    out = subprocess.run([nvcc_path(), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "unknown"


def gencode(arch: str) -> str:
    """sm_80 -> compute_80/sm_80; sm_90a -> compute_90a/sm_90a (wgmma/setmaxnreg need the 'a' target)."""
    num = arch.split("_", 1)[1]
    return f"arch=compute_{num},code=sm_{num}"


BUILD_DIR_PREFIX = "tile_ops_nvcc_"  # then the building process's pid


def build_cubin(source: str, arch: str, name: str = "kernel") -> tuple[bytes, dict]:
    """Compile CUDA source to a cubin; returns (cubin, resource usage parsed from ptxas -v).  nvcc runs in a
    directory of its own (its temporaries too), removed on return; those of killed builds are swept."""
    sweep_build_dirs()
    with tempfile.TemporaryDirectory(prefix=f"{BUILD_DIR_PREFIX}{os.getpid()}_") as tmp:
        cu, cubin = os.path.join(tmp, f"{name}.cu"), os.path.join(tmp, f"{name}.cubin")
        with open(cu, "w") as f:
            f.write(source)
        cmd = [nvcc_path(), "-cubin", "-O3", "-std=c++17", "-gencode", gencode(arch), "-Xptxas", "-v",
               "-w", "-o", cubin, cu]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TMPDIR": tmp})
        if proc.returncode != 0:
            raise RuntimeError(f"tile_ops: nvcc failed for {name} ({arch}):\n{proc.stderr[-4000:]}")
        with open(cubin, "rb") as f:
            return f.read(), parse_ptxas(proc.stderr)


@functools.lru_cache(maxsize=None)
def sweep_build_dirs(root: str | None = None) -> int:
    """Remove the build directories of processes that are gone (a build killed with SIGKILL runs no cleanup),
    once a process; those of an older layout (no pid) after a day.  How many were removed."""
    removed = 0
    for path in glob.glob(os.path.join(root or tempfile.gettempdir(), BUILD_DIR_PREFIX + "*")):
        pid = os.path.basename(path)[len(BUILD_DIR_PREFIX):].split("_", 1)[0]
        try:
            stale = not _alive(int(pid)) if pid.isdigit() else time.time() - os.path.getmtime(path) > 86400
        except OSError:  # removed meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def parse_ptxas(log: str) -> dict:
    info = {}
    m = re.search(r"Used (\d+) registers", log)
    if m:
        info["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        info["spill_stores"], info["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(\d+) bytes stack frame", log)
    if m:
        info["stack_frame"] = int(m.group(1))
    return info


def sass(cubin: bytes, tool: str | None = None) -> str:
    """The cubin's SASS listing, by ``tool`` (a cuobjdump path; default: the one found)."""
    tool = tool or _find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP")
    if tool is None:
        raise RuntimeError("tile_ops: cuobjdump not found (pip install nvidia-cuda-cuobjdump, or set TILE_OPS_CUOBJDUMP)")
    env = dict(os.environ)
    nvdisasm = _find_tool("nvdisasm", "NVDISASM_PATH")  # cuobjdump shells out to it for SASS
    if nvdisasm:
        env["PATH"] = os.path.dirname(nvdisasm) + os.pathsep + env.get("PATH", "")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        proc = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"tile_ops: cuobjdump failed: {proc.stderr.strip()}")
    return proc.stdout


def wgmma_early_reads(sass_text: str) -> list:
    """SASS instructions that touch a wgmma's registers while its group may still be in flight: any access to
    an HGMMA's accumulators, or a write to its A registers, after the HGMMA and before the
    ``WARPGROUP.DEPBAR.LE gsb0, N`` that retires its group (the N youngest groups run on; an HGMMA carrying
    ``gsb0`` closes a group; a later HGMMA on the same accumulators chains onto them).  The PTX orders such
    accesses after their ``wgmma.wait_group``; ptxas (CUDA 13.0) has hoisted reads above it after a partly
    unrolled loop, losing the last k-step.  A linear scan of the listing: a loop's back edge is not followed."""
    lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+([^;]*);", sass_text)]
    groups, open_group, early = [], [], []
    for line in lines:
        m = re.match(r"HGMMA\.64x(\d+)x\d+\.F32\S*\s+R(\d+),\s*(R(\d+))?", line)
        if m:
            acc = range(int(m.group(2)), int(m.group(2)) + int(m.group(1)) // 2)  # fp32: N/2 registers a thread
            a = range(int(m.group(4)), int(m.group(4)) + 4) if m.group(4) else range(0)
            open_group.append((acc, a))
            if "gsb0" in line:
                groups.append(open_group)
                open_group = []
            continue
        m = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", line)
        if m:
            younger = int(m.group(1), 16)
            groups = groups[len(groups) - younger:] if younger else []
            continue
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", line)]
        dest = re.match(r"(?:@!?U?P\w+\s+)?[A-Z][\w.]*\s+R(\d+)", line)
        for acc, a in (x for g in groups + [open_group] for x in g):
            if any(r in acc for r in regs) or (dest and int(dest.group(1)) in a):
                early.append(line)
                break
    return early


def check_accumulator_order(cubin: bytes, name: str) -> None:
    """Refuse a wgmma kernel whose SASS reads accumulators before their wait (``wgmma_early_reads``): it
    would compute wrong results. Unchecked where no cuobjdump is found (triton and nvidia-cuda-cuobjdump
    bundle one)."""
    tool = _find_tool("cuobjdump", "TILE_OPS_CUOBJDUMP")
    if tool is None:
        return
    early = wgmma_early_reads(sass(cubin, tool))
    if early:
        raise RuntimeError(f"tile_ops: ptxas scheduled {len(early)} instructions of kernel {name} that read wgmma "
                           f"accumulators before the wgmma.wait_group retiring them (first: {early[0]!r}); it "
                           f"would compute wrong results, so it is not used. Another config (block sizes, stages) "
                           f"avoids it; please report this one.")


def instruction_mix(sass_text: str) -> dict:
    """Opcode counts of a SASS listing (HMMA, LDSM, LDGSTS, ...)."""
    counts: dict = {}
    for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass_text):
        op = m.group(1)
        counts[op] = counts.get(op, 0) + 1
    return counts

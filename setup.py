"""Build script for tile_ops.

The package is pure Python except for ``tile_ops._C`` (csrc/: the launcher, and the ops' plans
against libtorch), a small pybind11 extension that dlopens libcuda at run time, so it builds with
no GPU and no CUDA toolkit.  It is built with ninja through torch's BuildExtension.  If that
build fails the install still succeeds (with a warning): tile_ops JIT-builds the same sources on
first use (tile_ops/jit/launcher.py).

Install for development:  pip install --no-build-isolation --no-deps -e .
"""

import os
import re
import shutil
import sys
import traceback

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
# `pip install -e .` runs `setup.py develop`, which recent setuptools hands on to a nested `pip install -e`
# with build isolation, where torch (the extension's headers) is missing: the nested build keeps ours.
os.environ.setdefault("PIP_NO_BUILD_ISOLATION", "0")
CSRC = ("launcher.cpp", "plans.cpp", "driver.h")  # the extension's sources, in csrc/


def read_version():
    with open(os.path.join(ROOT, "tile_ops", "__init__.py"), encoding="utf-8") as f:
        m = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
    if not m:
        raise RuntimeError("cannot find __version__ in tile_ops/__init__.py")
    return m.group(1)


try:  # the extension is built against libtorch, with ninja, by torch's BuildExtension
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    _BuildExtBase = BuildExtension.with_options(use_ninja=True)
    _NO_TORCH = None
except Exception as e:  # noqa: BLE001  (no torch at build time: tile_ops JIT-builds _C on first use)
    from setuptools.command.build_ext import build_ext as _BuildExtBase

    CppExtension, _NO_TORCH = None, f"{type(e).__name__}: {e}"


class OptionalBuildExt(_BuildExtBase):
    """build_ext that never fails the install: the runtime JIT-builds the launcher instead."""

    _failed = False

    def run(self):
        try:
            super().run()
        except Exception:  # noqa: BLE001
            self._failed = True
            sys.stderr.write(
                "\n" + "*" * 78 + "\n"
                "WARNING: building the tile_ops._C launcher extension failed; tile_ops will be\n"
                "installed without it and will JIT-build it from csrc/ on first use.\n"
                + traceback.format_exc() + "*" * 78 + "\n\n")

    def get_outputs(self):
        return [] if self._failed else super().get_outputs()

    def get_output_mapping(self):
        return {} if self._failed else super().get_output_mapping()


class BuildPyWithCsrc(build_py):
    """Also ship csrc/ as tile_ops/_csrc/ (for the JIT fallback in wheels)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # editable installs find csrc/ next to the package
        dst = os.path.join(self.build_lib, "tile_ops", "_csrc")
        os.makedirs(dst, exist_ok=True)
        for name in CSRC:
            shutil.copy2(os.path.join(ROOT, "csrc", name), dst)

    def get_outputs(self, include_bytecode=True):
        outputs = list(super().get_outputs(include_bytecode))
        if not getattr(self, "editable_mode", False):
            outputs += [os.path.join(self.build_lib, "tile_ops", "_csrc", name) for name in CSRC]
        return outputs


def extensions():
    if CppExtension is None:
        sys.stderr.write(f"WARNING: torch's cpp_extension is not importable at build time ({_NO_TORCH}); "
                         "tile_ops._C will be JIT-built on first use\n")
        return []
    return [
        CppExtension(  # torch's headers bring pybind11 (the same copy torch_python was built with)
            "tile_ops._C",
            sources=[os.path.join("csrc", name) for name in CSRC if name.endswith(".cpp")],
            extra_compile_args=["-O3", "-g0"],
            libraries=["dl"],
        )
    ]


setup(
    name="tile_ops",
    version=read_version(),
    description="A tile-level GPU kernel language on Apache TVM, and a PyTorch op library written in it",
    python_requires=">=3.10",
    packages=find_packages(include=["tile_ops", "tile_ops.*"]),
    include_package_data=True,
    package_data={"tile_ops": ["*.md", "**/*.md", "**/*.cu", "**/*.cuh", "**/*.h", "**/*.json"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithCsrc},
    install_requires=[
        "torch>=2.4",
        "apache-tvm==0.27.0.post1",
        "ninja",
        "pybind11",
        "triton",
    ],
    extras_require={"test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "nvidia-cuda-cuobjdump",
                             "transformers==5.17.0"],
                    "transformers": ["transformers>=5.17"]},
    entry_points={"console_scripts": ["tile_ops = tile_ops.__main__:main"]},
    zip_safe=False,
)

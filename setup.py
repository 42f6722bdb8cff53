"""Build fedfast's compiled extensions; the package's metadata lives in pyproject.toml.

* ``fedfast._C``: the C++ CPU kernels (csrc/).
* ``fedfast._C_cuda``: the CUDA kernels (kernels/*.cu, torch-free) plus their torch-side launchers
  (csrc/*_cuda.cpp), built only when the installed torch has CUDA (``torch.version.cuda``) and nvcc exists.

Both are compiled against the torch already installed, so build with ``pip install --no-build-isolation .``
(``make install`` for development: an editable install).

The extensions are optional. Without them fedfast runs on its pure-PyTorch reference backends on CPU (and on
Triton on a GPU), warning once per backend, and ``fedfast doctor`` says what is missing and how to build it:

* ``FEDFAST_NO_EXT=1``: build no extension (no compiler, and no torch, needed at build time);
* a failed compile (no C++ compiler, a broken toolchain) warns and goes on without that extension;
* ``FEDFAST_REQUIRE_EXT=1``: a failed compile is an error (``make`` and CI set it);
* ``FEDFAST_NO_CUDA=1``: skip the CUDA extension only.
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
NO_EXT = os.environ.get("FEDFAST_NO_EXT") == "1"
REQUIRE_EXT = os.environ.get("FEDFAST_REQUIRE_EXT") == "1"
# Commands that compile; metadata and sdist commands need no torch.
BUILDS = {"build", "build_ext", "bdist_wheel", "develop", "install", "editable_wheel"}
# -fopenmp: at::parallel_for is a header template whose OpenMP pragma must be compiled in here, or it runs
# serially. -fno-trapping-math lets gcc if-convert float selects (vectorisation); inf/NaN semantics stay.
# -g0: Python's own CFLAGS carry -g, which makes the CPU library 20 MB instead of 0.8 MB. -fno-wrapv: Python's CFLAGS
# carry -fwrapv (signed overflow defined), under which gcc 12 leaves loops with 64-bit counters unvectorised: the
# update norms' float lanes ran at 75 ms instead of 51 for 1000 rows of 199,210 values on the 2-core VM.
# torch: the releases fedfast is tested with (2.13 on CPU here, 2.11 + CUDA 13 on the GPU machine).
TORCH_RANGE = "torch>=2.11,<2.14"
NUMPY = "numpy>=1.24"
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-g0", "-fno-wrapv"]


def _say(msg: str) -> None:
    print(f"fedfast setup: {msg}", file=sys.stderr, flush=True)


def _extensions():
    """(ext_modules, cmdclass, torch requirement): the extensions this build compiles, the build_ext that compiles
    them, and the torch the result needs: a wheel with compiled extensions needs the torch minor release it was
    compiled against (an extension built for 2.13 does not load in 2.12); an sdist or a pure-Python build, any
    tested release."""
    if NO_EXT:
        _say("FEDFAST_NO_EXT=1: building without the compiled extensions (reference backends on CPU)")
        return [], {}, TORCH_RANGE
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        if BUILDS & set(sys.argv[1:]):
            sys.exit(
                "fedfast setup: torch is not importable here. fedfast's extensions are compiled against the "
                "torch you run: install torch first, then build without isolation:\n"
                "    pip install torch && pip install --no-build-isolation <fedfast source>\n"
                "or set FEDFAST_NO_EXT=1 for a pure-Python install (reference backends only)."
            )
        return [], {}, TORCH_RANGE

    exts = [
        cpp_extension.CppExtension(
            "fedfast._C",
            sources=sorted(glob.glob("csrc/*_cpu.cpp")) + ["csrc/bindings.cpp"],
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=["-fopenmp"],
        )
    ]
    if (
        torch.version.cuda is not None
        and (shutil.which("nvcc") or os.environ.get("CUDA_HOME"))
        and os.environ.get("FEDFAST_NO_CUDA") != "1"
    ):
        exts.append(
            cpp_extension.CUDAExtension(
                "fedfast._C_cuda",
                sources=sorted(glob.glob("kernels/*.cu")) + ["csrc/bindings_cuda.cpp"],
                include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "kernels")],
                extra_compile_args={"cxx": ["-O3", "-std=c++17", "-g0"], "nvcc": ["-O3", "-std=c++17", "-lineinfo"]},
            )
        )

    base = cpp_extension.BuildExtension.with_options(use_ninja=True)

    class OptionalBuildExt(base):
        """torch's BuildExtension, one extension at a time; a failed one is dropped with a warning (or, with
        FEDFAST_REQUIRE_EXT=1, fails the build) so that the package still installs and runs on the reference
        backends."""

        def build_extensions(self):
            built = []
            todo = list(self.extensions)
            # torch's build_extensions wraps the compiler's methods on every call: undo that between extensions
            saved = {k: getattr(self.compiler, k) for k in ("compile", "_compile", "spawn")}
            exts = list(self.compiler.src_extensions)
            for ext in todo:
                self.extensions = [ext]
                for k, v in saved.items():
                    setattr(self.compiler, k, v)
                self.compiler.src_extensions = list(exts)
                try:
                    super().build_extensions()
                except Exception as e:  # compiler missing or failing, ninja, linker: all mean "not built"
                    if REQUIRE_EXT:
                        raise
                    _say(
                        f"WARNING: could not build {ext.name} ({type(e).__name__}: {str(e).strip()[:300]}). "
                        f"fedfast will run without it, on the reference backends; `fedfast doctor` says how to "
                        f"build it (a C++ compiler: gcc >= 9 or clang; nvcc for the CUDA one)."
                    )
                else:
                    built.append(ext)
            self.extensions = built

    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    binary = not ({"sdist", "egg_info"} & set(sys.argv[1:]))
    return exts, {"build_ext": OptionalBuildExt}, f"torch=={major}.{minor}.*" if binary else TORCH_RANGE


ext_modules, cmdclass, torch_req = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass, install_requires=[torch_req, NUMPY])

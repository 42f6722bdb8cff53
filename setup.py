"""Build fedfast's extensions.

* ``fedfast._C``: the C++ CPU kernels (csrc/), always built.
* ``fedfast._C_cuda``: the CUDA kernels (kernels/*.cu, torch-free) plus their torch-side launchers
  (csrc/*_cuda.cpp), built only when the installed torch has CUDA (``torch.version.cuda``) and nvcc exists.

Install for development with ``pip install -e . --no-build-isolation`` (uses the torch already installed).
"""
import glob
import os
import re
import shutil

from setuptools import find_packages, setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
# -fopenmp: at::parallel_for is a header template whose OpenMP pragma must be compiled in here, or it runs
# serially. -fno-trapping-math lets gcc if-convert float selects (vectorisation); inf/NaN semantics stay.
CXX_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

ext_modules = [
    cpp_extension.CppExtension(
        "fedfast._C",
        sources=sorted(glob.glob("csrc/*_cpu.cpp")) + ["csrc/bindings.cpp"],
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=["-fopenmp"],
    )
]

import torch  # noqa: E402

if torch.version.cuda is not None and (shutil.which("nvcc") or os.environ.get("CUDA_HOME")) \
        and os.environ.get("FEDFAST_NO_CUDA") != "1":
    ext_modules.append(
        cpp_extension.CUDAExtension(
            "fedfast._C_cuda",
            sources=sorted(glob.glob("kernels/*.cu")) + ["csrc/bindings_cuda.cpp"],
            include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, "kernels")],
            extra_compile_args={"cxx": ["-O3", "-std=c++17"],
                                "nvcc": ["-O3", "-std=c++17", "-lineinfo"]},
        )
    )

def _version() -> str:
    """fedfast/_version.py's __version__, read without importing the package (its one place)."""
    with open(os.path.join(ROOT, "fedfast", "_version.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


setup(
    name="fedfast",
    version=_version(),
    description="Fused knowledge-distillation losses and kernels for federated learning simulation",
    packages=find_packages(include=["fedfast", "fedfast.*"]),
    python_requires=">=3.10",
    ext_modules=ext_modules,
    package_data={"fedfast": ["presets/*.toml"]},
    extras_require={"progress": ["tqdm"], "plot": ["matplotlib"], "tensorboard": ["tensorboard"],
                    "study": ["tqdm", "matplotlib", "tensorboard"],
                    "text": ["transformers>=5,<6", "tokenizers>=0.22"]},
    entry_points={"console_scripts": ["fedfast=fedfast.cli:console"]},
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

"""Build of attn_ext._C: the CPU kernels always, the CUDA kernels when both a CUDA
toolkit and a CUDA-enabled torch are present (never by accident on a CPU-only torch).

Environment switches:
  ATTN_EXT_CPU_ISA   avx2 (default on x86-64) | native | generic: vector ISA of the CPU kernels
  ATTN_EXT_CUDA      auto (default) | 0 | 1: force the CUDA build off or on
  ATTN_EXT_DEBUG     1: -O0 -g
  MAX_JOBS           parallel compile jobs (ninja), e.g. 2 on a 2-core machine
"""
import glob
import os
import platform

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


def _cuda_enabled():
    mode = os.environ.get("ATTN_EXT_CUDA", "auto")
    if mode == "0":
        return False
    have = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode == "1" and not have:
        raise RuntimeError("ATTN_EXT_CUDA=1 but torch is not a CUDA build or no CUDA toolkit was found")
    return have and bool(_sources("csrc/cuda/**/*.cu"))


def _cpu_isa_flags():
    isa = os.environ.get("ATTN_EXT_CPU_ISA", "avx2" if platform.machine() in ("x86_64", "AMD64") else "generic")
    return {"avx2": ["-mavx2", "-mfma", "-mf16c"], "native": ["-march=native"], "generic": []}[isa]


def _extension():
    debug = os.environ.get("ATTN_EXT_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cxx = opt + ["-fopenmp", "-fvisibility=hidden"] + _cpu_isa_flags()
    sources = (_sources("csrc/*.cpp") + _sources("csrc/common/*.cpp") + _sources("csrc/cpu/*.cpp")
               + _sources("csrc/linear/*.cpp") + _sources("csrc/spatial/*.cpp"))
    kwargs = dict(extra_link_args=["-fopenmp"])
    if _cuda_enabled():
        cxx.append("-DATTN_EXT_WITH_CUDA")
        arch = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
        nvcc = opt + ["-std=c++17", "--expt-relaxed-constexpr", "-DATTN_EXT_WITH_CUDA"]
        sources += _sources("csrc/cuda/**/*.cu") + _sources("csrc/cuda/**/*.cpp")
        print(f"attn_ext: building CUDA kernels for {arch}")
        return cpp_extension.CUDAExtension("attn_ext._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return cpp_extension.CppExtension("attn_ext._C", sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)

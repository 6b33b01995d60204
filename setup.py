"""Build of attn_ext._C: the CPU kernels always, the CUDA kernels when both a CUDA
toolkit and a CUDA-enabled torch are present (never by accident on a CPU-only torch).

Environment switches:
  ATTN_EXT_CPU_ISA   avx2 (default on x86-64) | native | generic: vector ISA of the CPU kernels
  ATTN_EXT_CUDA      auto (default) | 0 | 1: force the CUDA build off or on
  ATTN_EXT_DEBUG     1: -O0 -g
  ATTN_EXT_SANITIZE  e.g. "address,undefined": a sanitizer build (-O1 -g, frame pointers, the
                     sanitizers' runtime linked; objects in their own build folder); run it
                     with tools/sanitize_cpu.sh, which preloads the runtime into Python
  ATTN_EXT_CUDA_HEAD_DIMS   e.g. "128" or "64,128": tensor-core forward head dims to compile
                            (of csrc/attention/cuda/instantiations.json's, today 64, 128, 256;
                            default all; others run on the generic kernel)
  ATTN_EXT_CUDA_DTYPES      e.g. "bf16" or "bf16,f32": attention kernel dtypes to compile
                            (of the same file's, today f32, f64, bf16, f16; default all; others
                            raise on CUDA)
  ATTN_EXT_CUDA_BACKWARD    0: no attention backward kernels on CUDA (default 1)
  CUTLASS_PATH              a CUTLASS checkout (its include/ holds cute/ and cutlass/); unset, the
                            headers of the installed nvidia-cutlass package (tools/bootstrap.sh
                            installs it where nvcc is found). Without them the CuTe forward
                            (flash_fwd_cute.cuh) is left out of a CUDA build
  TORCH_CUDA_ARCH_LIST      e.g. "9.0a": GPU architectures (default: the visible GPUs', an H100's
                            as 9.0a; with none visible "8.0+PTX;9.0a"). The Hopper forward
                            (flash_fwd_hopper.cuh: wgmma, setmaxnreg; the default on 9.x) is
                            compiled only when the list names 9.0a (plain 9.0 has neither
                            instruction)
  MAX_JOBS           parallel compile jobs (ninja), e.g. 2 on a 2-core machine
"""

import glob
import json
import os
import platform
import re
import sys
import sysconfig

import torch
from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
# One persistent object folder for every way of building (setup.py build_ext, pip wheel, pip
# install -e, which otherwise compiles in a new temporary folder each time): ninja then
# recompiles only the sources whose text, included headers or compile command changed.
SANITIZE = os.environ.get("ATTN_EXT_SANITIZE", "")
BUILD_TEMP = os.path.join(
    ROOT,
    "build",
    f"temp.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    + (f"-sanitize-{SANITIZE.replace(',', '-')}" if SANITIZE else ""),
)
# The instantiated CUDA attention dtypes and head dims (also read by
# tools/gen_cuda_instantiations.py, which writes the instantiations and the launcher's header).
KERNEL_SET = os.path.join(CSRC, "attention", "cuda", "instantiations.json")
INSTANTIATIONS = os.path.join("csrc", "attention", "cuda", "instantiations")


def _sources(pattern):
    return sorted(
        os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    )


def _in_folder(path, name):
    return name in path.split(os.sep)[:-1]


def _cuda_enabled():
    mode = os.environ.get("ATTN_EXT_CUDA", "auto")
    if mode == "0":
        return False
    have = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if mode == "1" and not have:
        raise RuntimeError(
            "ATTN_EXT_CUDA=1 but torch is not a CUDA build or no CUDA toolkit was found"
        )
    return have and bool(_sources("csrc/**/*.cu"))


# Attention instantiations (tools/gen_cuda_instantiations.py writes them).
_INSTANTIATION = re.compile(
    r"^(?P<pass>fwd|bwd)_(?P<kernel>mma|cute|hopper|generic)_(?P<dtype>[a-z0-9]+)(?:_hd(?P<hd>\d+))?\.cu$"
)


def _kernel_set():
    """(dtype tags, tensor-core head dims), each in the bit order of its nvcc mask."""
    with open(KERNEL_SET) as f:
        ks = json.load(f)
    return tuple(ks["dtypes"]), tuple(ks["mma_head_dims"])


def cutlass_include():
    """The folder holding cute/ and cutlass/ (CUTLASS_PATH's include/, else the nvidia-cutlass
    package's cutlass_library/source/include, found without importing the package), or None."""
    import importlib.util

    if os.environ.get("CUTLASS_PATH"):
        inc = os.path.join(os.environ["CUTLASS_PATH"], "include")
        if not os.path.isdir(os.path.join(inc, "cute")):
            raise RuntimeError(f"CUTLASS_PATH: no include/cute under {os.environ['CUTLASS_PATH']}")
        return inc
    spec = importlib.util.find_spec("cutlass_library")
    for base in (spec.submodule_search_locations or []) if spec else []:
        inc = os.path.join(base, "source", "include")
        if os.path.isdir(os.path.join(inc, "cute")):
            return inc
    return None


def _env_list(name, allowed, convert=str):
    raw = os.environ.get(name, "")
    if not raw.strip():
        return list(allowed)
    vals = [convert(x.strip()) for x in raw.split(",") if x.strip()]
    bad = [x for x in vals if x not in allowed]
    if bad:
        raise RuntimeError(
            f"{name}: unknown value(s) {bad}; expected a comma-separated subset of {list(allowed)}"
        )
    return vals


def _cuda_attention_selection():
    """The instantiation files to compile and the nvcc defines that tell the dispatcher."""
    all_dtypes, all_head_dims = _kernel_set()
    dtypes = _env_list("ATTN_EXT_CUDA_DTYPES", all_dtypes)
    head_dims = _env_list("ATTN_EXT_CUDA_HEAD_DIMS", all_head_dims, int)
    backward = os.environ.get("ATTN_EXT_CUDA_BACKWARD", "1") != "0"
    cute = cutlass_include() is not None
    hopper = cute and _builds_sm90a()
    keep = []
    for src in _sources(os.path.join(INSTANTIATIONS, "*.cu")):
        m = _INSTANTIATION.match(os.path.basename(src))
        if m is None:
            raise RuntimeError(
                f"{src}: not an instantiation name tools/gen_cuda_instantiations.py writes"
            )
        if m["dtype"] not in dtypes or (m["pass"] == "bwd" and not backward):
            continue
        if (m["kernel"] == "cute" and not cute) or (m["kernel"] == "hopper" and not hopper):
            continue
        if m["hd"] is not None and int(m["hd"]) not in head_dims:
            continue
        keep.append(src)
    dtype_mask = sum(1 << i for i, d in enumerate(all_dtypes) if d in dtypes)
    hd_mask = sum(1 << i for i, d in enumerate(all_head_dims) if d in head_dims)
    defines = [
        f"-DATTN_EXT_CUDA_DTYPE_MASK={dtype_mask}",
        f"-DATTN_EXT_CUDA_HEAD_DIM_MASK={hd_mask}",
        f"-DATTN_EXT_CUDA_BACKWARD={int(backward)}",
        f"-DATTN_EXT_CUDA_CUTE={int(cute)}",
        f"-DATTN_EXT_CUDA_HOPPER={int(hopper)}",
    ]
    return keep, defines


def _cpu_isa_flags():
    isa = os.environ.get(
        "ATTN_EXT_CPU_ISA", "avx2" if platform.machine() in ("x86_64", "AMD64") else "generic"
    )
    return {"avx2": ["-mavx2", "-mfma", "-mf16c"], "native": ["-march=native"], "generic": []}[isa]


def _cuda_arch_list():
    """TORCH_CUDA_ARCH_LIST as given; unset, the architectures of the visible GPUs, with PTX of
    the newest (torch's own default) except that compute capability 9.0 builds as 9.0a: the
    Hopper forward, the default there, needs sm_90a's wgmma, and 9.0a code runs only on 9.0
    (so no PTX for it); with no GPU visible (a build machine), A100 and H100 machine code plus
    A100 PTX, which the driver compiles for any newer GPU at load."""
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        if torch.cuda.is_available():
            caps = sorted(
                {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
            )
            archs = [
                f"{major}.{minor}" + ("a" if (major, minor) == (9, 0) else "")
                for major, minor in caps
            ]
            if not archs[-1].endswith("a"):
                archs[-1] += "+PTX"
            os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0+PTX;9.0a"
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def _builds_sm90a():
    """Whether the architectures include sm_90a (TORCH_CUDA_ARCH_LIST's "9.0a", with or without
    +PTX): plain 9.0 has no wgmma."""
    arch = _cuda_arch_list()
    return re.search(r"(^|[;\s])9\.0a(\+PTX)?($|[;\s])", arch) is not None


def _runtime_link_args():
    """Link the C++ runtime dynamically, as torch itself is linked. A GPU image (torch 2.11,
    Ubuntu g++ 13.3, 2026-11-23) linked libstdc++ statically into the extension: its copy of
    the stream code then ran against the process's libstdc++ data (Python's -Bsymbolic-functions
    binds functions locally, data globally), and the first error message that formatted a
    number crashed. Naming the runtime library makes the linker resolve every libstdc++
    symbol from it, so no archive member is pulled in."""
    return ["-l:libstdc++.so.6"] if platform.system() == "Linux" else []


def _extension(cuda):
    """One rule for the sources: every csrc/**/*.cpp outside a cuda/ folder is built always;
    a CUDA build adds every .cu and every .cpp of the cuda/ folders, of the generated attention
    instantiations only those setup.py keeps (_cuda_attention_selection)."""
    debug = os.environ.get("ATTN_EXT_DEBUG") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    sanitize = [f"-fsanitize={SANITIZE}", "-fno-omit-frame-pointer"] if SANITIZE else []
    if SANITIZE:
        opt = ["-O1", "-g"] + sanitize + ["-fno-sanitize-recover=all"]
    cxx = opt + ["-fopenmp", "-fvisibility=hidden"] + _cpu_isa_flags()
    every_cpp = _sources("csrc/**/*.cpp")
    sources = [s for s in every_cpp if not _in_folder(s, "cuda")]
    # includes are relative to csrc/ (csrc/README.md); a changed header recompiles the objects
    # that include it (ninja's dependency files; _BuildExt always runs ninja)
    kwargs = dict(
        include_dirs=[CSRC], extra_link_args=["-fopenmp"] + sanitize + _runtime_link_args()
    )
    if cuda:
        cxx.append("-DATTN_EXT_WITH_CUDA")
        arch = _cuda_arch_list()
        instantiations, defines = _cuda_attention_selection()
        nvcc = opt + ["-std=c++17", "--expt-relaxed-constexpr", "-DATTN_EXT_WITH_CUDA"] + defines
        if cutlass_include() is not None:
            kwargs["include_dirs"].append(cutlass_include())
        else:
            print("attn_ext: no CUTLASS headers (pip install nvidia-cutlass): no CuTe forward")
        hand_written = [s for s in _sources("csrc/**/*.cu") if not _in_folder(s, "instantiations")]
        sources += hand_written + instantiations + [s for s in every_cpp if _in_folder(s, "cuda")]
        print(f"attn_ext: building CUDA kernels for {arch}")
        return cpp_extension.CUDAExtension(
            "attn_ext._C", sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs
        )
    return cpp_extension.CppExtension(
        "attn_ext._C", sources, extra_compile_args={"cxx": cxx}, **kwargs
    )


def _version(cuda):
    """attn_ext/__init__.py's __version__, with torch's local label for a CUDA build
    (0.1.0+cu130): a CUDA wheel needs a CUDA torch, which its requirement cannot say (pip sees
    a PyPI CUDA torch as plain 2.x.y)."""
    with open(os.path.join(ROOT, "attn_ext", "__init__.py")) as f:
        base = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)
    return f"{base}+cu{torch.version.cuda.replace('.', '')}" if cuda else base


def _torch_requirement():
    """The torch this build compiled against (major.minor.patch): the C++ ABI of an extension
    holds for that torch only, so a wheel built once installs where the same torch is."""
    return f"torch=={torch.__version__.split('+')[0]}"


class _BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    def finalize_options(self):
        super().finalize_options()
        self.build_temp = BUILD_TEMP
        # Always hand the sources to ninja, which skips what is up to date (seconds) and, unlike
        # setuptools' timestamp check, also sees changed compile flags (ATTN_EXT_* switches).
        self.force = True


if __name__ == "__main__":  # tests import this file for its kernel-set logic
    _cuda = _cuda_enabled()
    setup(
        version=_version(_cuda),
        install_requires=[_torch_requirement()],
        ext_modules=[_extension(_cuda)],
        cmdclass={"build_ext": _BuildExt},
    )

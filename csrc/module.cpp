// The Python extension module attn_ext._C: importing it runs the static registrations of
// the operators. Its one Python function says which CPU block products this process runs, for
// the main job's and the benchmarks' headers (timings depend on it).
#include <Python.h>

#include <exception>
#include <c10/util/Exception.h>

#include "attention/cpu/block_kernels.h"
#include "common/cpu/vec_math.h"

namespace {

// cpu_block_kernels() -> "amx" | "avx512" | "avx2" | "blas" (a build without the packed kernels;
// "amx": the bf16 forward on AMX tiles, the rest on the AVX-512 products); raises
// RuntimeError when ATTN_EXT_CPU_KERNELS names kernels this CPU cannot run.
PyObject* cpu_block_kernels(PyObject*, PyObject*) {
#ifdef ATTN_EXT_AVX2
  try {
    return PyUnicode_FromString(attn_ext::cpu::block_kernels().name);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
#else
  return PyUnicode_FromString("blas");
#endif
}

PyMethodDef methods[] = {{"cpu_block_kernels", cpu_block_kernels, METH_NOARGS,
                          "The CPU block products this process runs: amx, avx512, avx2 or blas."},
                         {nullptr, nullptr, 0, nullptr}};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

// The Python extension module attn_ext._C: importing it runs the static registrations of
// the operators; it defines no Python functions of its own.
#include <Python.h>

PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

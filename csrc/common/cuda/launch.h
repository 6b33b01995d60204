#pragma once
// What every family's CUDA host entry points share. Kernel sources (.cu) include no ATen
// headers, only their family's <family>_launch.h (which includes this file) and the plain
// parameter / policy headers, so that they compile with nvcc alone (the CI compile check); the
// op wrappers (*_cuda.cpp) validate inputs, pick the stream and check the returned launch status.
#include <cuda_runtime.h>

namespace attn_ext::cuda {

// Element type of the tensors a kernel reads and writes (accumulation is fp32, fp64 for fp64).
enum class ElemKind : int { kFloat32, kFloat64, kBFloat16, kFloat16 };

}  // namespace attn_ext::cuda

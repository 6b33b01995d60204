// Autocast: inside torch.autocast the attention ops run at the autocast dtype, as
// F.scaled_dot_product_attention does (bf16 on the CPU by default, fp16 / bf16 on CUDA): q, k
// and v are cast (differentiably: autocast sits before autograd), masks, ALiBi slopes and sinks
// stay as given (the kernels read them in the accumulation type). decode_attention is left out:
// it reads a persistent cache, which a cast would copy on every step.
#include <string_view>
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace attn_ext {
namespace {

bool autocast_argument(std::string_view name) {
  return name == "q" || name == "k" || name == "v";
}

template <c10::DeviceType kDevice, c10::DispatchKey kKey>
void autocast_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& args = op.schema().arguments();
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const size_t first = stack->size() - args.size();
  for (size_t i = 0; i < args.size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (value.isTensor() && autocast_argument(args[i].name()))
      value = at::autocast::cached_cast(dtype, value.toTensor(), kDevice);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(kKey);
  op.callBoxed(stack);
}

constexpr const char* kAutocastOps[] = {"attention", "attention_varlen", "attention_weights",
                                        "attention_probabilities"};

}  // namespace

TORCH_LIBRARY_IMPL(attn_ext, AutocastCPU, m) {
  for (const char* name : kAutocastOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &autocast_boxed<c10::DeviceType::CPU, c10::DispatchKey::AutocastCPU>>());
  }
}

TORCH_LIBRARY_IMPL(attn_ext, AutocastCUDA, m) {
  for (const char* name : kAutocastOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<
                     &autocast_boxed<c10::DeviceType::CUDA, c10::DispatchKey::AutocastCUDA>>());
  }
}

}  // namespace attn_ext

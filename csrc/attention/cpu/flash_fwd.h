#pragma once
// The CPU flash forward for other ops that attend through it (decode_attention's query blocks
// of at least kPackedMinQueries rows, decoding/cpu/decode_attention.cpp).
#include <ATen/core/Tensor.h>

#include "attention/params.h"

namespace attn_ext::cpu {

// The forward of p, whose outputs are allocated and pointed at (allocate_outputs), for q's
// dtype: the products with_fwd_products picks, the band and score modifiers of p.
void flash_forward(const char* op, AttentionParams& p, const at::Tensor& q);

}  // namespace attn_ext::cpu

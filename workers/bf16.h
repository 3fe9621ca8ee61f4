// bf16 carried as its raw 16 bits, for the native kernels (paged_decode.cpp, fused_ops.cpp):
// bf16 -> float is exact; float -> bf16 rounds to nearest even, as torch does (NaN stays NaN).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace raypd_bf16 {

inline float bf16_to_f(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += ((u >> 16) & 1u) + 0x7FFFu;   // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace raypd_bf16

// AMX for the native kernels (linear_amx.cpp, attention_bf16.cpp): the target attribute of a
// function that uses AMX-BF16 tiles, and the tile configuration _tile_loadconfig reads.
// Callers check raypd_linear_amx_max() > 0 first (the CPU has AMX-BF16 and Linux granted this
// process its tile state).
#pragma once

#include <immintrin.h>

#include <cstdint>

#define AMX_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

namespace raypd_amx {

struct alignas(64) TileConfig {   // palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// _tile_release() from code built without AMX in its target (the kernels' OpenMP regions: on a
// CPU whose -march=native lacks AMX, such as an AVX2 Zen 3, GCC refuses to inline the intrinsic
// there, so the library did not build at all)
AMX_BF16 inline void release_tiles() { _tile_release(); }

}  // namespace raypd_amx

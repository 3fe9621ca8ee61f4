// AMX for the native kernels (linear_amx.cpp, attention_amx.cpp): the target attribute of a
// function that uses AMX-BF16 tiles, and the tile configuration _tile_loadconfig reads.
// Callers check raypd_linear_amx_max() > 0 first (the CPU has AMX-BF16 and Linux granted this
// process its tile state).
#pragma once

#include <cstdint>

#define AMX_BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))

namespace raypd_amx {

struct alignas(64) TileConfig {   // palette 1
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

}  // namespace raypd_amx

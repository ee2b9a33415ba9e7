// What the AMX kernels share (linear_bf16_amx.cpp, linear_quant_amx.cpp): whether this CPU and OS give the tiles
// out, and a tile configuration. The kernels are compiled with AMX enabled per function (LLMGW_AMX), so a build
// for the AVX-512 BF16 level (cooperlake) carries them and calls them only where `usable()`.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#define LLMGW_AMX __attribute__((target("amx-tile,amx-bf16")))

namespace llmgw_amx {

inline bool usable() {
  static const bool usable = [] {
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16")) return false;
    // Linux hands out the tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return usable;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0 .. count - 1 of 16 rows × 64 bytes (16 fp32, or 16 pairs of bf16). Kept in a global: GCC dropped the
// stores to a local config it saw no reader for, and ldtilecfg then faulted on zeros.
inline TileConfig uniform_config(int count) {
  TileConfig config;
  for (int t = 0; t < count; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  return config;
}

}  // namespace llmgw_amx

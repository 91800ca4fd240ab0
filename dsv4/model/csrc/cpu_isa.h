// What the dsv4_fp4 extension's translation units share: the instruction-set paths and the bfloat16 widening.
// The Python side (dsv4/model/fp4_kernel.py, ISAS) passes one of these codes to every op.
#pragma once
#include <cstdint>
#include <cstring>

namespace dsv4_isa {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// Whether this CPU (and, for kAmx, the kernel's leave to use the tiles) runs path `isa`.
// kAvx2: AVX2 + FMA; kAvx512: AVX-512 F+BW+VL+DQ+VNNI + FMA; kAmx: kAvx512's and AMX-TILE/INT8.
bool cpu_has(int64_t isa);

// A bfloat16's bits as the float32 of the same value (exact).
inline float widen_bf16(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace dsv4_isa

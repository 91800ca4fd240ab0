// The instruction-set paths of the dsv4_fp4 extension, shared by its translation units.
// The Python side (dsv4/model/fp4_kernel.py, ISAS) passes one of these codes to every op.
#pragma once
#include <cstdint>

namespace dsv4_isa {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };

// Whether this CPU (and, for kAmx, the kernel's leave to use the tiles) runs path `isa`.
// kAvx2: AVX2 + FMA; kAvx512: AVX-512 F+BW+VL+DQ+VNNI + FMA; kAmx: kAvx512's and AMX-TILE/INT8.
bool cpu_has(int64_t isa);

}  // namespace dsv4_isa

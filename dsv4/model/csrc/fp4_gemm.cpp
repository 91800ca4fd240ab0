// Fused FP4 (e2m1 + E8M0 per 32) GEMMs on the CPU, computed from the checkpoint's layout.
// Built by `python -m dsv4.model.fp4_kernel --build`; called through torch.ops.dsv4_fp4.*
// (dsv4/model/fp4_kernel.py owns the Python side, the contract and the torch fallback).
//
// Weight: packed uint8 [N, K/2] (element 2k in the low nibble of byte k, 2k+1 in the high
// one; rows contiguous, any row stride), scales uint8 E8M0 bytes [N, K/32] (any row stride).
// A nibble c maps to w2x = 2 * e2m1(c), an integer in [-12, 12]; W = w2x * 2^(S - 128).
//
// linear_a8 (int8 activations, the exact contract every path reproduces bit for bit):
//   for each (m, n): acc = 0.f; for b in 0..K/32-1 in order:
//     d = sum_{k in block b} xq[m, k] * w2x[n, k]          (int32, exact)
//     acc = acc + float(d) * 2^(S[n, b] - 128)            (IEEE mul, then add: no fma)
//   y[m, n] = acc * xs[m]
// where 2^(S-128) is the float32 power of two (S = 0, 1: denormals 2^-128, 2^-127) and
// S = 255 (NaN in the E8M0 spec) is NaN. The product is exact unless it overflows (then
// +-inf, as in the fallback). Built with -ffp-contract=off so that nothing is fused.
//
// linear_f (float32 activations): per (m, n, b): four fma chains over the elements
// 8q..8q+7 of the block (q = 0..3), s = (a0 + a1) + (a2 + a3), acc = fma(s, 2^(S-128), acc)
// in the SIMD paths (mul + add in the scalar one): the same operations for a row whatever M
// is, so a row's result does not depend on the rows batched with it.
//
// Paths (per-ISA functions in this one translation unit, picked by the caller):
//   isa 3: isa 2 below 12 rows of x; from 12 rows linear_a8 runs on Intel AMX (tdpbssd)
//   isa 2: AVX-512 F+BW+VL+VNNI (vpdpbusd), tiles of 16 output rows
//   isa 1: AVX2 + FMA (vpmaddubsw + vpmaddwd), tiles of 8 output rows
//   isa 0: scalar
// The SIMD paths hold a tile's weights transposed in registers: lane r of register q holds
// dword q (packed bytes 4q..4q+3) of row r's block, so that one broadcast int8 quad of x
// feeds all rows and each lane accumulates one (m, n, block) without horizontal sums. The
// weights enter vpdpbusd/vpmaddubsw as unsigned w2x + 12 in [0, 24]; the offset is taken
// back with 12 * sum(x of the block), computed once per row of x.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_isa.h"

#if defined(__x86_64__)
#define DSV4_X86 1
#include <immintrin.h>
#endif
#if DSV4_X86 && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define DSV4_AMX 1  // a compiler with AMX intrinsics, and a kernel that grants the tiles
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

namespace {

constexpr int kBlock = 32;      // weights per E8M0 scale
constexpr int kBlockBytes = 16; // packed bytes per block
constexpr int kOffset = 12;     // the unsigned weights are w2x + kOffset

// 2 * e2m1 by nibble, and the same plus kOffset (the unsigned SIMD operand)
constexpr int8_t kW2x[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
alignas(16) constexpr uint8_t kW2xOff[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
alignas(32) constexpr float kW2xF[16] = {0.f, 1.f, 2.f, 3.f, 4.f, 6.f, 8.f, 12.f,
                                         -0.f, -1.f, -2.f, -3.f, -4.f, -6.f, -8.f, -12.f};

// 2^(S - 128) as float32 bits: normal for S >= 2, denormal for S = 0, 1, NaN for S = 255.
inline uint32_t scale_bits(uint32_t s) {
  if (s == 255) return 0x7FC00000u;
  return s >= 2 ? (s - 1) << 23 : 0x00200000u << s;
}

inline float scale_f(uint8_t s) {
  uint32_t b = scale_bits(s);
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// offsets of block b's even x elements in a row of Gemm::xg (its odd ones: + 64), and of its
// -12 * sum in a row of Gemm::nxs
inline int64_t xoff(int64_t b) { return (b >> 2) * 128 + (b & 3) * 16; }
inline int64_t noff(int64_t b) { return (b >> 2) * 16 + (b & 3) * 4; }

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

struct Gemm {
  const uint8_t* w;  // packed weight, row n at w + n * ws
  int64_t ws;
  const uint8_t* s;  // E8M0 bytes, row n at s + n * ss
  int64_t ss;
  int64_t M, N, K, B;  // B = K / 32
  float* y;            // [M, N] contiguous
  // linear_a8: x regrouped by 4 blocks (128 bytes a group, the last one zero-padded): the
  // even elements of the group's blocks (16 bytes each), then their odd elements
  const int8_t* xg = nullptr;   // [M, xstride]
  int64_t xstride = 0;          // 128 * ceil(B / 4)
  const int32_t* nxs = nullptr; // [M, nstride]: 16 ints a group, int 4j = -12 * sum of x over block j, others 0
  int64_t nstride = 0;          // 16 * ceil(B / 4)
  const float* xs = nullptr;    // [M]
  // linear_f
  const float* xf = nullptr;    // [M, K] contiguous float32
};

// ------------------------------------------------------------------------------ scalar
void a8_scalar(const Gemm& g, int64_t n0, int64_t n1) {
  std::vector<int8_t> row(g.K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = g.w + n * g.ws;
    for (int64_t k = 0; k < g.K / 2; ++k) {  // unpacked by block: even elements, then odd
      int64_t b = k / kBlockBytes, j = k % kBlockBytes;
      row[b * kBlock + j] = kW2x[wr[k] & 15];
      row[b * kBlock + kBlockBytes + j] = kW2x[wr[k] >> 4];
    }
    for (int64_t m = 0; m < g.M; ++m) {
      const int8_t* x = g.xg + m * g.xstride;
      float acc = 0.f;
      for (int64_t b = 0; b < g.B; ++b) {
        int32_t d = 0;
        const int8_t* xe = x + xoff(b);
        for (int j = 0; j < kBlockBytes; ++j)
          d += int32_t(xe[j]) * int32_t(row[b * kBlock + j]) + int32_t(xe[64 + j]) * int32_t(row[b * kBlock + kBlockBytes + j]);
        float p = float(d) * scale_f(g.s[n * g.ss + b]);
        acc = acc + p;
      }
      g.y[m * g.N + n] = acc * g.xs[m];
    }
  }
}

void f_scalar(const Gemm& g, int64_t n0, int64_t n1) {
  std::vector<float> row(g.K);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = g.w + n * g.ws;
    for (int64_t k = 0; k < g.K / 2; ++k) {
      row[2 * k] = kW2xF[wr[k] & 15];
      row[2 * k + 1] = kW2xF[wr[k] >> 4];
    }
    for (int64_t m = 0; m < g.M; ++m) {
      const float* x = g.xf + m * g.K;
      float acc = 0.f;
      for (int64_t b = 0; b < g.B; ++b) {
        float a[4];
        for (int q = 0; q < 4; ++q) {
          const float* xb = x + b * kBlock + 8 * q;
          const float* wb = row.data() + b * kBlock + 8 * q;
          float t = xb[0] * wb[0];
          for (int j = 1; j < 8; ++j) t = t + xb[j] * wb[j];
          a[q] = t;
        }
        float sb = (a[0] + a[1]) + (a[2] + a[3]);
        acc = acc + sb * scale_f(g.s[n * g.ss + b]);
      }
      g.y[m * g.N + n] = acc;
    }
  }
}

#if DSV4_X86
// Software prefetch into L2 of the tile kPrefetchTiles ahead (within this thread's range),
// step by step as this tile is read: linear lines, which the memory serves better than the
// tile's own interleaved rows (measured: decode from DRAM 1.5-1.8x faster with it).
constexpr int kPrefetchTiles = 4;

// prefetcht1 as volatile asm: GCC deems _mm_prefetch const, and a helper that only
// prefetches pure, and drops its calls as dead code
inline void prefetch_l2(const char* p) { __asm__ volatile("prefetcht1 %0" : : "m"(*p)); }

struct Prefetch {
  const char* w = nullptr;  // the weight rows of that tile, as one byte range
  const char* s = nullptr;  // its scale rows
  int64_t wbytes = 0, sbytes = 0;

  void set(const Gemm& g, int64_t n, int64_t n_end) {
    if (n >= n_end) {
      w = nullptr;
      return;
    }
    w = (const char*)(g.w + n * g.ws);
    s = (const char*)(g.s + n * g.ss);
    wbytes = (n_end - n - 1) * g.ws + g.K / 2;
    sbytes = (n_end - n - 1) * g.ss + g.B;
  }
  // step: b4 / 4; lines: 64-byte lines the tile reads a step (16 or 8 rows x 64 bytes)
  void step(int64_t st, int lines) const {
    if (!w) return;
    const int64_t off = st * 64 * lines;
    for (int i = 0; i < lines; ++i)
      if (off + 64 * i < wbytes) prefetch_l2(w + off + 64 * i);
    if (st * 64 < sbytes) prefetch_l2(s + st * 64);
  }
};

// ------------------------------------------------------------------------------ AVX-512
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma")))
#define T512I T512 __attribute__((always_inline)) inline

// The scale bytes of 16 rows for blocks b4..b4+3 (a dword per row), gathered.
struct Scales16 {
  Prefetch pf;
  __m512i idx;
  const uint8_t* base;
  int64_t B;
  alignas(64) uint8_t pad[16 * 4];
};

T512I void scales16_init(Scales16& sc, const Gemm& g, int64_t n0, int nvalid) {
  alignas(64) int32_t idx[16];
  if (g.B >= 4) {
    for (int r = 0; r < 16; ++r) idx[r] = int32_t(std::min(r, nvalid - 1) * g.ss);
    sc.base = g.s + n0 * g.ss;
    sc.B = g.B;
  } else {  // fewer than 4 blocks a row: a zero-padded copy, so that the dword reads stay inside
    std::memset(sc.pad, 0, sizeof(sc.pad));
    for (int r = 0; r < 16; ++r) {
      for (int64_t b = 0; b < g.B; ++b) sc.pad[4 * r + b] = g.s[(n0 + std::min(r, nvalid - 1)) * g.ss + b];
      idx[r] = 4 * r;
    }
    sc.base = sc.pad;
    sc.B = 4;
  }
  sc.idx = _mm512_load_si512(idx);
}

// dwords of the scale rows at blocks o..o+3, o = min(b4, B - 4); block b is byte b - o
T512I __m512i scales16_gather(const Scales16& sc, int64_t b4, int64_t& o) {
  o = std::min<int64_t>(b4, sc.B - 4);
  return _mm512_i32gather_epi32(sc.idx, (const void*)(sc.base + o), 1);
}

T512I __m512 scales16_float(__m512i G, int shift) {
  const __m512i s = _mm512_and_si512(_mm512_srl_epi32(G, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(0xFF));
  __m512i v = _mm512_slli_epi32(_mm512_sub_epi32(s, _mm512_set1_epi32(1)), 23);
  v = _mm512_mask_mov_epi32(v, _mm512_cmplt_epu32_mask(s, _mm512_set1_epi32(2)),
                            _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), s));
  v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(v);
}

// Block b of 16 rows, transposed: T[q] lane r = packed bytes 4q..4q+3 of row r's block.
// Z_g holds rows g, 4 + g, 8 + g, 12 + g in its 128-bit lanes; the in-lane 4x4 transpose
// of Z_0..Z_3 then puts row 4L + g at dword 4L + g, the identity.
T512I void load16(const uint8_t* const* rows, int64_t off, __m512i T[4]) {
  __m512i Z[4];
  for (int g = 0; g < 4; ++g) {
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(rows[g] + off)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(rows[4 + g] + off)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(rows[8 + g] + off)), 2);
    Z[g] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i*)(rows[12 + g] + off)), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(Z[0], Z[1]), t1 = _mm512_unpackhi_epi32(Z[0], Z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(Z[2], Z[3]), t3 = _mm512_unpackhi_epi32(Z[2], Z[3]);
  T[0] = _mm512_unpacklo_epi64(t0, t2);
  T[1] = _mm512_unpackhi_epi64(t0, t2);
  T[2] = _mm512_unpacklo_epi64(t1, t3);
  T[3] = _mm512_unpackhi_epi64(t1, t3);
}

T512I void rows16(const Gemm& g, int64_t n0, int nvalid, const uint8_t* rows[16]) {
  for (int r = 0; r < 16; ++r) rows[r] = g.w + (n0 + std::min(r, nvalid - 1)) * g.ws;
}

// acc += w (u8) . broadcast int8 quad at p (s8), with the broadcast folded into the
// instruction's memory operand (compilers emit a separate vpbroadcastd otherwise)
T512I __m512i dpbusd_bcst(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}

// One block b of a 16-row tile for MT rows of x: T[q] as load16 makes it (or four of
// load16x4's); facc[i] += float(d) * f for each row, the contract's step.
// The unsigned weights (w2x + 12) of a transposed block: lo[q] from the low nibbles of T[q]
// (elements 8q, 8q + 2, ...), hi[q] from the high ones.
T512I void unpack512(const __m512i* T, __m512i lo[4], __m512i hi[4]) {
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kW2xOff));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < 4; ++q) {
    lo[q] = _mm512_shuffle_epi8(lut, _mm512_and_si512(T[q], m4));
    hi[q] = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(T[q], 4), m4));
  }
}

template <int MT>
T512I void a8_rows512(const Gemm& g, const __m512i* lo, const __m512i* hi, __m512 f, int64_t b, int64_t m0,
                      __m512 facc[MT]);

template <int MT>
T512I void a8_block512(const Gemm& g, const __m512i* T, __m512 f, int64_t b, int64_t m0, __m512 facc[MT]) {
  __m512i lo[4], hi[4];
  unpack512(T, lo, hi);
  a8_rows512<MT>(g, lo, hi, f, b, m0, facc);
}

// Block b for MT rows of x, from its unpacked weights: facc[i] += float(d) * f.
template <int MT>
T512I void a8_rows512(const Gemm& g, const __m512i* lo, const __m512i* hi, __m512 f, int64_t b, int64_t m0,
                      __m512 facc[MT]) {
  // rows of x in groups of up to 4 whose dpbusd chains interleave (a chain alone waits on
  // the instruction's latency)
#pragma GCC unroll 4
  for (int i0 = 0; i0 < MT; i0 += 4) {
    constexpr int kG = MT < 4 ? MT : 4;
    const int ng = MT - i0 < kG ? MT - i0 : kG;
    const int8_t* xb[kG];
    __m512i acc[kG];
#pragma GCC unroll 4
    for (int j = 0; j < kG; ++j) {
      if (j >= ng) break;
      xb[j] = g.xg + (m0 + i0 + j) * g.xstride + xoff(b);
      acc[j] = _mm512_set1_epi32(g.nxs[(m0 + i0 + j) * g.nstride + noff(b)]);
    }
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
#pragma GCC unroll 4
      for (int j = 0; j < kG; ++j)
        if (j < ng) acc[j] = dpbusd_bcst(acc[j], lo[q], xb[j] + 4 * q);
#pragma GCC unroll 4
      for (int j = 0; j < kG; ++j)
        if (j < ng) acc[j] = dpbusd_bcst(acc[j], hi[q], xb[j] + 64 + 4 * q);
    }
#pragma GCC unroll 4
    for (int j = 0; j < kG; ++j)
      if (j < ng) facc[i0 + j] = _mm512_add_ps(facc[i0 + j], _mm512_mul_ps(_mm512_cvtepi32_ps(acc[j]), f));
  }
}

T512I void store16(const Gemm& g, int64_t m, int64_t n0, int nvalid, __m512 facc) {
  _mm512_mask_storeu_ps(g.y + m * g.N + n0, __mmask16((1u << nvalid) - 1),
                        _mm512_mul_ps(facc, _mm512_set1_ps(g.xs[m])));
}

// The tail blocks B4..B-1 (B not a multiple of 4) of a tile, block by block.
template <int MT>
T512I void a8_tail512(const Gemm& g, const uint8_t* const* rows, int64_t B4, int64_t m0, Scales16& sc,
                            __m512 facc[MT]) {
  if (B4 >= g.B) return;
  int64_t o;
  const __m512i G = scales16_gather(sc, B4, o);
  for (int64_t b = B4; b < g.B; ++b) {
    __m512i T[4];
    load16(rows, b * kBlockBytes, T);
    a8_block512<MT>(g, T, scales16_float(G, int(8 * (b - o))), b, m0, facc);
  }
}

// Many rows of x: the tile's weights transposed once per block and shared by MT rows.
template <int MT>
T512 void a8_tile_avx512(const Gemm& g, int64_t n0, int nvalid, int64_t m0, Scales16& sc) {
  const uint8_t* rows[16];
  rows16(g, n0, nvalid, rows);
  __m512 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm512_setzero_ps();
  const int64_t B4 = g.B & ~int64_t(3);
  for (int64_t b4 = 0; b4 < B4; b4 += 4) {
    if (m0 == 0) sc.pf.step(b4 / 4, 16);
    int64_t o;
    const __m512i G = scales16_gather(sc, b4, o);
#pragma GCC unroll 4
    for (int bb = 0; bb < 4; ++bb) {
      __m512i T[4];
      load16(rows, (b4 + bb) * kBlockBytes, T);
      a8_block512<MT>(g, T, scales16_float(G, 8 * bb), b4 + bb, m0, facc);
    }
  }
  a8_tail512<MT>(g, rows, B4, m0, sc, facc);
  for (int i = 0; i < MT; ++i) store16(g, m0 + i, n0, nvalid, facc[i]);
}

// Many rows of x (prefill): the tile's weights unpacked once into `buf` (per block the 8
// registers of unsigned weights, then its 16 scales as float), then read by every tile of
// MT rows of x. 9 x 64 bytes a block: 72 KiB a tile at K = 4096, in L2.
constexpr int kBufRegs = 9;

// Each block b of a 16-row tile in order: sink(b, T, f) with its transposed bytes T (load16)
// and its 16 scales f as float; the tile's prefetch steps along.
template <class Sink>
T512I void for_blocks16(const Gemm& g, int64_t n0, int nvalid, Scales16& sc, const Sink& sink) {
  const uint8_t* rows[16];
  rows16(g, n0, nvalid, rows);
  for (int64_t b4 = 0; b4 < g.B; b4 += 4) {
    sc.pf.step(b4 / 4, 16);
    int64_t o;
    const __m512i G = scales16_gather(sc, b4, o);
    for (int64_t b = b4; b < std::min<int64_t>(b4 + 4, g.B); ++b) {
      __m512i T[4];
      load16(rows, b * kBlockBytes, T);
      sink(b, T, scales16_float(G, int(8 * (b - o))));
    }
  }
}

struct BufSink {  // a8_unpack_tile512's: the unsigned weights' 8 registers, then the scales
  __m512i* buf;
  T512I void operator()(int64_t b, const __m512i* T, __m512 f) const {
    __m512i* dst = buf + b * kBufRegs;
    unpack512(T, dst, dst + 4);
    dst[8] = _mm512_castps_si512(f);
  }
};

T512 void a8_unpack_tile512(const Gemm& g, int64_t n0, int nvalid, Scales16& sc, __m512i* buf) {
  for_blocks16(g, n0, nvalid, sc, BufSink{buf});
}

template <int MT>
T512 void a8_tile_buf512(const Gemm& g, const __m512i* buf, int64_t n0, int nvalid, int64_t m0, int64_t mt) {
  if constexpr (MT > 1) {
    if (mt < MT) return a8_tile_buf512<MT - 1>(g, buf, n0, nvalid, m0, mt);
  }
  __m512 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g.B; ++b) {
    const __m512i* w = buf + b * kBufRegs;
    __m512i lo[4], hi[4];
    for (int q = 0; q < 4; ++q) {
      lo[q] = _mm512_load_si512((const void*)(w + q));
      hi[q] = _mm512_load_si512((const void*)(w + 4 + q));
    }
    a8_rows512<MT>(g, lo, hi, _mm512_castsi512_ps(_mm512_load_si512((const void*)(w + 8))), b, m0, facc);
  }
  for (int i = 0; i < MT; ++i) store16(g, m0 + i, n0, nvalid, facc[i]);
}

// Few rows of x (decode): each weight row read as 64 bytes (4 blocks) and multiplied in
// place; the 4 partial sums a block leaves in a 128-bit lane are added up for 4 rows at
// once, and a 4x4 transpose of 128-bit lanes gives one register a block for 16 rows.
template <int MT>
T512 void a8_tile_h512(const Gemm& g, int64_t n0, int nvalid, int64_t m0, Scales16& sc) {
  const uint8_t* rows[16];
  rows16(g, n0, nvalid, rows);
  const __m512i lut = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kW2xOff));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm512_setzero_ps();
  const int64_t B4 = g.B & ~int64_t(3);
  for (int64_t b4 = 0; b4 < B4; b4 += 4) {
    int64_t o;
    if (m0 == 0) sc.pf.step(b4 / 4, 16);
    const __m512i G = scales16_gather(sc, b4, o);
    __m512i xl[MT], xh[MT], c[MT], V[MT][4];
    for (int i = 0; i < MT; ++i) {
      const int8_t* xb = g.xg + (m0 + i) * g.xstride + xoff(b4);
      xl[i] = _mm512_loadu_si512((const void*)xb);
      xh[i] = _mm512_loadu_si512((const void*)(xb + 64));
      c[i] = _mm512_loadu_si512((const void*)(g.nxs + (m0 + i) * g.nstride + noff(b4)));
    }
#pragma GCC unroll 4
    for (int G4 = 0; G4 < 4; ++G4) {  // rows 4 G4 .. 4 G4 + 3
      __m512i a[MT][4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512i v = _mm512_loadu_si512((const void*)(rows[4 * G4 + r] + b4 * kBlockBytes));
        const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v, m4));
        const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        for (int i = 0; i < MT; ++i)
          a[i][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c[i], lo, xl[i]), hi, xh[i]);
      }
      for (int i = 0; i < MT; ++i) {  // lane L: dword r = block b4 + L of row 4 G4 + r
        const __m512i s0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[i][0], a[i][1]), _mm512_unpackhi_epi32(a[i][0], a[i][1]));
        const __m512i s1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[i][2], a[i][3]), _mm512_unpackhi_epi32(a[i][2], a[i][3]));
        V[i][G4] = _mm512_add_epi32(_mm512_unpacklo_epi64(s0, s1), _mm512_unpackhi_epi64(s0, s1));
      }
    }
    __m512 f[4];
    for (int bb = 0; bb < 4; ++bb) f[bb] = scales16_float(G, 8 * bb);
    for (int i = 0; i < MT; ++i) {  // 128-bit lanes transposed: U[bb] dword r = block b4 + bb of row r
      const __m512i u0 = _mm512_shuffle_i32x4(V[i][0], V[i][1], 0x44), u1 = _mm512_shuffle_i32x4(V[i][0], V[i][1], 0xEE);
      const __m512i u2 = _mm512_shuffle_i32x4(V[i][2], V[i][3], 0x44), u3 = _mm512_shuffle_i32x4(V[i][2], V[i][3], 0xEE);
      const __m512i U[4] = {_mm512_shuffle_i32x4(u0, u2, 0x88), _mm512_shuffle_i32x4(u0, u2, 0xDD),
                            _mm512_shuffle_i32x4(u1, u3, 0x88), _mm512_shuffle_i32x4(u1, u3, 0xDD)};
      for (int bb = 0; bb < 4; ++bb) facc[i] = _mm512_add_ps(facc[i], _mm512_mul_ps(_mm512_cvtepi32_ps(U[bb]), f[bb]));
    }
  }
  a8_tail512<MT>(g, rows, B4, m0, sc, facc);
  for (int i = 0; i < MT; ++i) store16(g, m0 + i, n0, nvalid, facc[i]);
}

template <int MT>
T512 void f_tile_avx512(const Gemm& g, int64_t n0, int nvalid, int64_t m0, Scales16& sc) {
  const uint8_t* rows[16];
  rows16(g, n0, nvalid, rows);
  const __m512 lut = _mm512_load_ps(kW2xF);
  __m512 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm512_setzero_ps();
  const float* x = g.xf + m0 * g.K;
  for (int64_t b4 = 0; b4 < g.B; b4 += 4) {
    if (m0 == 0) sc.pf.step(b4 / 4, 16);
    int64_t o;
    const __m512i G = scales16_gather(sc, b4, o);
    const int64_t bend = std::min<int64_t>(b4 + 4, g.B);
    for (int64_t b = b4; b < bend; ++b) {
      const __m512 f = scales16_float(G, int(8 * (b - o)));
      __m512i T[4];
      load16(rows, b * kBlockBytes, T);
      __m512 s01[MT], a2[MT];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m512 w[8];  // element 8q + j of each row's block: nibble j of dword q
        w[0] = _mm512_permutexvar_ps(T[q], lut);
#pragma GCC unroll 8
        for (int j = 1; j < 8; ++j) w[j] = _mm512_permutexvar_ps(_mm512_srli_epi32(T[q], 4 * j), lut);
#pragma GCC unroll 8
        for (int i = 0; i < MT; ++i) {
          const float* xb = x + i * g.K + b * kBlock + 8 * q;
          __m512 a = _mm512_mul_ps(w[0], _mm512_set1_ps(xb[0]));
#pragma GCC unroll 8
          for (int j = 1; j < 8; ++j) a = _mm512_fmadd_ps(w[j], _mm512_set1_ps(xb[j]), a);
          if (q == 0) s01[i] = a;
          else if (q == 1) s01[i] = _mm512_add_ps(s01[i], a);
          else if (q == 2) a2[i] = a;
          else facc[i] = _mm512_fmadd_ps(_mm512_add_ps(s01[i], _mm512_add_ps(a2[i], a)), f, facc[i]);
        }
      }
    }
  }
  const __mmask16 keep = __mmask16((1u << nvalid) - 1);
  for (int i = 0; i < MT; ++i) _mm512_mask_storeu_ps(g.y + (m0 + i) * g.N + n0, keep, facc[i]);
}

#ifndef DSV4_MT
#define DSV4_MT 8
#endif
constexpr int kA8Rows512 = DSV4_MT;  // rows of x per register tile
constexpr int kFRows512 = 4;

template <int MT>
T512 void a8_rows_avx512(const Gemm& g, int64_t n0, int nvalid, int64_t m0, int64_t mt, Scales16& sc) {
  if constexpr (MT > 1) {
    if (mt < MT) return a8_rows_avx512<MT - 1>(g, n0, nvalid, m0, mt, sc);
  }
  a8_tile_avx512<MT>(g, n0, nvalid, m0, sc);
}

template <int MT>
T512 void f_rows_avx512(const Gemm& g, int64_t n0, int nvalid, int64_t m0, int64_t mt, Scales16& sc) {
  if constexpr (MT > 1) {
    if (mt < MT) return f_rows_avx512<MT - 1>(g, n0, nvalid, m0, mt, sc);
  }
  f_tile_avx512<MT>(g, n0, nvalid, m0, sc);
}

#ifndef DSV4_H_ROWS
#define DSV4_H_ROWS 2
#endif
constexpr int kA8RowsH = DSV4_H_ROWS;  // up to this many rows of x: the horizontal kernel

T512 void a8_avx512(const Gemm& g, int64_t t0, int64_t t1) {
  Scales16 sc;
  std::unique_ptr<__m512i, decltype(&std::free)> buf(nullptr, &std::free);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = 16 * t;
    const int nvalid = int(std::min<int64_t>(16, g.N - n0));
    scales16_init(sc, g, n0, nvalid);
    sc.pf.set(g, n0 + 16 * kPrefetchTiles, std::min(g.N, 16 * t1));
    if (g.M <= kA8RowsH) {
      for (int64_t m0 = 0; m0 < g.M; m0 += 2) {
        if (g.M - m0 >= 2 && kA8RowsH >= 2) a8_tile_h512<2>(g, n0, nvalid, m0, sc);
        else a8_tile_h512<1>(g, n0, nvalid, m0, sc);
      }
      continue;
    }
    if (g.M <= kA8Rows512) {
      a8_rows_avx512<kA8Rows512>(g, n0, nvalid, 0, g.M, sc);
      continue;
    }
    if (!buf) buf.reset(static_cast<__m512i*>(std::aligned_alloc(64, g.B * kBufRegs * 64)));
    a8_unpack_tile512(g, n0, nvalid, sc, buf.get());
    for (int64_t m0 = 0; m0 < g.M; m0 += kA8Rows512)
      a8_tile_buf512<kA8Rows512>(g, buf.get(), n0, nvalid, m0, std::min<int64_t>(kA8Rows512, g.M - m0));
  }
}

T512 void f_avx512(const Gemm& g, int64_t t0, int64_t t1) {
  Scales16 sc;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = 16 * t;
    const int nvalid = int(std::min<int64_t>(16, g.N - n0));
    scales16_init(sc, g, n0, nvalid);
    sc.pf.set(g, n0 + 16 * kPrefetchTiles, std::min(g.N, 16 * t1));
    for (int64_t m0 = 0; m0 < g.M; m0 += kFRows512)
      f_rows_avx512<kFRows512>(g, n0, nvalid, m0, std::min<int64_t>(kFRows512, g.M - m0), sc);
  }
}

#if DSV4_AMX
// ------------------------------------------------------------------------------ AMX
// isa 3: AVX-512 VNNI below kAmxRows (12) rows of x, Intel AMX (tdpbssd) from there on. Each
// 16-column tile's weights are unpacked once into B tiles (signed w2x: 8 rows of 16 columns
// x 4 k a block); x comes block-major ([B][Mp][32], rows zero-padded to a multiple of 16), so
// an A tile is 512 contiguous bytes. A pass takes 32 rows x 32 columns (tiles C 0..3, A 4..5,
// B 6..7): per block 4 tdpbssd, whose int32 tiles are the exact block dot products d, then the
// contract's step facc += float(d) * f in AVX-512 on every C row, so the bits are the other
// paths'.
#ifndef DSV4_AMX_ROWS
#define DSV4_AMX_ROWS 12
#endif
constexpr int64_t kAmxRows = DSV4_AMX_ROWS;  // from 12 rows AMX is faster (benchmarks/fp4_gemm.py)

#define TAMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,amx-tile,amx-int8")))

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

TAMX void amx_config() {
  TileConfig c;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;      // C: 16 rows x 16 int32
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = kBlock;  // A: 16 rows x 32 int8
  for (int t = 6; t < 8; ++t) c.rows[t] = kBlock / 4, c.colsb[t] = 64;  // B: k / 4 rows x 16 columns x 4 k
  _tile_loadconfig(&c);
}

// Block b of 16 weight rows as a B tile: byte 64 kq + 4 r + i = w2x[row r, k = 4 kq + i].
// From load16's T[q] (lane r: packed bytes 4q..4q+3 of the block, elements 8q..8q+7): the
// signed nibble values lo, hi interleaved per dword give elements 8q..8q+3 (row 2q of the
// tile) and 8q+4..8q+7 (row 2q+1).
T512I void amx_unpack_block(const __m512i T[4], int8_t* dst) {  // AVX-512 only
  const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kW2x));
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < 4; ++q) {
    const __m512i lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(T[q], m4));
    const __m512i hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(T[q], 4), m4));
    const __m512 u0 = _mm512_castsi512_ps(_mm512_unpacklo_epi8(lo, hi));  // per lane: E0 O0 E1 O1
    const __m512 u1 = _mm512_castsi512_ps(_mm512_unpackhi_epi8(lo, hi));  // E2 O2 E3 O3
    _mm512_store_si512((void*)(dst + 128 * q), _mm512_castps_si512(_mm512_shuffle_ps(u0, u1, 0x88)));
    _mm512_store_si512((void*)(dst + 128 * q + 64), _mm512_castps_si512(_mm512_shuffle_ps(u0, u1, 0xDD)));
  }
}

// Rows m0 .. m0 + 16 MT - 1 of the block-major x against NT unpacked column tiles (columns
// n0 .. n0 + 16 NT - 1): C tile 2 i + j holds row group i, column tile j. Per block: MT A
// loads, NT B loads, MT * NT tdpbssd, then the contract's step on every C row.
template <int MT, int NT>
TAMX void amx_pass(const Gemm& g, const int8_t* xb, int64_t Mp, int8_t* const* wbuf, float* const* fbuf, int64_t m0,
                   int64_t n0) {
  alignas(64) int32_t c[4][256];
  alignas(64) float acc[4][256];
  std::memset(acc, 0, sizeof(acc));
  const int8_t* x = xb + m0 * kBlock;
  const int64_t xblock = Mp * kBlock;  // bytes from one block of x to the next
  for (int64_t b = 0; b < g.B; ++b) {
    const int8_t* xa = x + b * xblock;
    _tile_loadd(4, xa, kBlock);
    _tile_loadd(6, wbuf[0] + b * 512, 64);
    _tile_zero(0);
    _tile_dpbssd(0, 4, 6);
    if constexpr (NT > 1) {
      _tile_loadd(7, wbuf[1] + b * 512, 64);
      _tile_zero(1);
      _tile_dpbssd(1, 4, 7);
    }
    if constexpr (MT > 1) {
      _tile_loadd(5, xa + 16 * kBlock, kBlock);
      _tile_zero(2);
      _tile_dpbssd(2, 5, 6);
    }
    if constexpr (MT > 1 && NT > 1) {
      _tile_zero(3);
      _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, c[0], 64);
    if constexpr (NT > 1) _tile_stored(1, c[1], 64);
    if constexpr (MT > 1) _tile_stored(2, c[2], 64);
    if constexpr (MT > 1 && NT > 1) _tile_stored(3, c[3], 64);
#pragma GCC unroll 2
    for (int j = 0; j < NT; ++j) {
      const __m512 f = _mm512_load_ps(fbuf[j] + 16 * b);
#pragma GCC unroll 2
      for (int i = 0; i < MT; ++i) {
        const int t = 2 * i + j;
#pragma GCC unroll 16
        for (int r = 0; r < 16; ++r) {
          const __m512 d = _mm512_cvtepi32_ps(_mm512_load_si512((const void*)(c[t] + 16 * r)));
          _mm512_store_ps(acc[t] + 16 * r, _mm512_add_ps(_mm512_load_ps(acc[t] + 16 * r), _mm512_mul_ps(d, f)));
        }
      }
    }
  }
  for (int j = 0; j < NT; ++j) {
    const int nvalid = int(std::min<int64_t>(16, g.N - n0 - 16 * j));
    for (int i = 0; i < MT; ++i)
      for (int64_t r = 0; r < 16 && m0 + 16 * i + r < g.M; ++r)
        store16(g, m0 + 16 * i + r, n0 + 16 * j, nvalid, _mm512_load_ps(acc[2 * i + j] + 16 * r));
  }
}

struct TileSink {  // amx_unpack_tile's: B tiles into wbuf, the scales as float into fbuf
  int8_t* wbuf;
  float* fbuf;
  T512I void operator()(int64_t b, const __m512i* T, __m512 f) const {
    amx_unpack_block(T, wbuf + b * 512);
    _mm512_store_ps(fbuf + 16 * b, f);
  }
};

// Column tile n0 unpacked: its B tiles into wbuf, its scales as float into fbuf.
TAMX void amx_unpack_tile(const Gemm& g, int64_t n0, int64_t n_end, int8_t* wbuf, float* fbuf) {
  Scales16 sc;
  const int nvalid = int(std::min<int64_t>(16, g.N - n0));
  scales16_init(sc, g, n0, nvalid);
  sc.pf.set(g, n0 + 32, n_end);
  for_blocks16(g, n0, nvalid, sc, TileSink{wbuf, fbuf});
}

// Pairs of column tiles p0..p1 (columns 32 p .. 32 p + 31) for all M rows of x (block-major,
// Mp = M rounded up to 16).
TAMX void a8_amx(const Gemm& g, const int8_t* xb, int64_t Mp, int64_t p0, int64_t p1) {
  amx_config();
  auto wmem = std::unique_ptr<int8_t, decltype(&std::free)>(
      static_cast<int8_t*>(std::aligned_alloc(64, 2 * g.B * 512)), &std::free);
  auto fmem = std::unique_ptr<float, decltype(&std::free)>(
      static_cast<float*>(std::aligned_alloc(64, 2 * g.B * 64)), &std::free);
  int8_t* wbuf[2] = {wmem.get(), wmem.get() + g.B * 512};
  float* fbuf[2] = {fmem.get(), fmem.get() + g.B * 16};
  const int64_t n_end = std::min(g.N, 32 * p1);
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = 32 * p;
    const bool two = n0 + 16 < g.N;
    amx_unpack_tile(g, n0, n_end, wbuf[0], fbuf[0]);
    if (two) amx_unpack_tile(g, n0 + 16, n_end, wbuf[1], fbuf[1]);
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const bool rows2 = m0 + 16 < Mp;
      if (rows2 && two) amx_pass<2, 2>(g, xb, Mp, wbuf, fbuf, m0, n0);
      else if (rows2) amx_pass<2, 1>(g, xb, Mp, wbuf, fbuf, m0, n0);
      else if (two) amx_pass<1, 2>(g, xb, Mp, wbuf, fbuf, m0, n0);
      else amx_pass<1, 1>(g, xb, Mp, wbuf, fbuf, m0, n0);
    }
  }
  _tile_release();
}

// Whether this process may use AMX tiles: Linux hands the tile state out on request.
bool amx_permitted() {
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#endif  // DSV4_AMX

// ------------------------------------------------------------------------------ AVX2
#define T256 __attribute__((target("avx2,fma")))
#define T256I T256 __attribute__((always_inline)) inline

struct Scales8 {
  Prefetch pf;
  __m256i idx;
  const uint8_t* base;
  int64_t B;
  alignas(32) uint8_t pad[8 * 4];
};

T256I void scales8_init(Scales8& sc, const Gemm& g, int64_t n0, int nvalid) {
  alignas(32) int32_t idx[8];
  if (g.B >= 4) {
    for (int r = 0; r < 8; ++r) idx[r] = int32_t(std::min(r, nvalid - 1) * g.ss);
    sc.base = g.s + n0 * g.ss;
    sc.B = g.B;
  } else {
    std::memset(sc.pad, 0, sizeof(sc.pad));
    for (int r = 0; r < 8; ++r) {
      for (int64_t b = 0; b < g.B; ++b) sc.pad[4 * r + b] = g.s[(n0 + std::min(r, nvalid - 1)) * g.ss + b];
      idx[r] = 4 * r;
    }
    sc.base = sc.pad;
    sc.B = 4;
  }
  sc.idx = _mm256_load_si256((const __m256i*)idx);
}

T256I __m256i scales8_gather(const Scales8& sc, int64_t b4, int64_t& o) {
  o = std::min<int64_t>(b4, sc.B - 4);
  return _mm256_i32gather_epi32((const int*)(sc.base + o), sc.idx, 1);
}

T256I __m256 scales8_float(__m256i G, int shift) {
  const __m256i s = _mm256_and_si256(_mm256_srl_epi32(G, _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(0xFF));
  __m256i v = _mm256_slli_epi32(_mm256_sub_epi32(s, _mm256_set1_epi32(1)), 23);
  v = _mm256_blendv_epi8(v, _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), s),
                         _mm256_cmpgt_epi32(_mm256_set1_epi32(2), s));
  v = _mm256_blendv_epi8(v, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
  return _mm256_castsi256_ps(v);
}

// Block b of 8 rows, transposed: T[q] lane r = packed bytes 4q..4q+3 of row r's block
// (Z_g holds rows g and 4 + g; the in-lane 4x4 transpose puts row 4L + g at dword 4L + g).
T256I void load8(const uint8_t* const* rows, int64_t off, __m256i T[4]) {
  __m256i Z[4];
  for (int g = 0; g < 4; ++g) {
    const __m256i z = _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(rows[g] + off)));
    Z[g] = _mm256_inserti128_si256(z, _mm_loadu_si128((const __m128i*)(rows[4 + g] + off)), 1);
  }
  const __m256i t0 = _mm256_unpacklo_epi32(Z[0], Z[1]), t1 = _mm256_unpackhi_epi32(Z[0], Z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(Z[2], Z[3]), t3 = _mm256_unpackhi_epi32(Z[2], Z[3]);
  T[0] = _mm256_unpacklo_epi64(t0, t2);
  T[1] = _mm256_unpackhi_epi64(t0, t2);
  T[2] = _mm256_unpacklo_epi64(t1, t3);
  T[3] = _mm256_unpackhi_epi64(t1, t3);
}

T256I void rows8(const Gemm& g, int64_t n0, int nvalid, const uint8_t* rows[8]) {
  for (int r = 0; r < 8; ++r) rows[r] = g.w + (n0 + std::min(r, nvalid - 1)) * g.ws;
}

T256I void store8(float* dst, __m256 v, int nvalid) {
  if (nvalid == 8) return _mm256_storeu_ps(dst, v);
  alignas(32) float tmp[8];
  _mm256_store_ps(tmp, v);
  for (int r = 0; r < nvalid; ++r) dst[r] = tmp[r];
}

template <int MT>
T256 void a8_tile_avx2(const Gemm& g, int64_t n0, int nvalid, int64_t m0, Scales8& sc) {
  const uint8_t* rows[8];
  rows8(g, n0, nvalid, rows);
  const __m256i lut = _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kW2xOff));
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm256_setzero_ps();
  for (int64_t b4 = 0; b4 < g.B; b4 += 4) {
    if (m0 == 0) sc.pf.step(b4 / 4, 8);
    int64_t o;
    const __m256i G = scales8_gather(sc, b4, o);
    const int64_t bend = std::min<int64_t>(b4 + 4, g.B);
    for (int64_t b = b4; b < bend; ++b) {
      const __m256 f = scales8_float(G, int(8 * (b - o)));
      __m256i T[4], lo[4], hi[4];
      load8(rows, b * kBlockBytes, T);
      for (int q = 0; q < 4; ++q) {
        lo[q] = _mm256_shuffle_epi8(lut, _mm256_and_si256(T[q], m4));
        hi[q] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(T[q], 4), m4));
      }
#pragma GCC unroll 8
      for (int i = 0; i < MT; ++i) {
        const int8_t* xb = g.xg + (m0 + i) * g.xstride + xoff(b);
        __m256i acc = _mm256_set1_epi32(g.nxs[(m0 + i) * g.nstride + noff(b)]);
        // int16 lanes sum at most 8 products of u8 <= 24 and s8 >= -128: |.| <= 24576, no saturation
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256i s16 = _mm256_setzero_si256();
#pragma GCC unroll 2
          for (int q = 2 * h; q < 2 * h + 2; ++q) {
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(lo[q], _mm256_set1_epi32(load_i32(xb + 4 * q))));
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(hi[q], _mm256_set1_epi32(load_i32(xb + 64 + 4 * q))));
          }
          acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s16, ones));
        }
        const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), f);
        facc[i] = _mm256_add_ps(facc[i], p);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    store8(g.y + (m0 + i) * g.N + n0, _mm256_mul_ps(facc[i], _mm256_set1_ps(g.xs[m0 + i])), nvalid);
}

template <int MT>
T256 void f_tile_avx2(const Gemm& g, int64_t n0, int nvalid, int64_t m0, Scales8& sc) {
  const uint8_t* rows[8];
  rows8(g, n0, nvalid, rows);
  const __m256 mag = _mm256_load_ps(kW2xF);  // entries 0..7: the magnitudes
  const __m256i sign = _mm256_set1_epi32(int32_t(0x80000000u));
  __m256 facc[MT];
  for (int i = 0; i < MT; ++i) facc[i] = _mm256_setzero_ps();
  const float* x = g.xf + m0 * g.K;
  for (int64_t b4 = 0; b4 < g.B; b4 += 4) {
    if (m0 == 0) sc.pf.step(b4 / 4, 8);
    int64_t o;
    const __m256i G = scales8_gather(sc, b4, o);
    const int64_t bend = std::min<int64_t>(b4 + 4, g.B);
    for (int64_t b = b4; b < bend; ++b) {
      const __m256 f = scales8_float(G, int(8 * (b - o)));
      __m256i T[4];
      load8(rows, b * kBlockBytes, T);
      __m256 s01[MT], a2[MT];
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        __m256 w[8];  // nibble j: magnitude by its low 3 bits, sign bit 4j + 3 moved to bit 31
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m256 m = _mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(T[q], 4 * j));
          const __m256i s = _mm256_and_si256(_mm256_slli_epi32(T[q], 28 - 4 * j), sign);
          w[j] = _mm256_or_ps(m, _mm256_castsi256_ps(s));
        }
#pragma GCC unroll 4
        for (int i = 0; i < MT; ++i) {
          const float* xb = x + i * g.K + b * kBlock + 8 * q;
          __m256 a = _mm256_mul_ps(w[0], _mm256_set1_ps(xb[0]));
#pragma GCC unroll 8
          for (int j = 1; j < 8; ++j) a = _mm256_fmadd_ps(w[j], _mm256_set1_ps(xb[j]), a);
          if (q == 0) s01[i] = a;
          else if (q == 1) s01[i] = _mm256_add_ps(s01[i], a);
          else if (q == 2) a2[i] = a;
          else facc[i] = _mm256_fmadd_ps(_mm256_add_ps(s01[i], _mm256_add_ps(a2[i], a)), f, facc[i]);
        }
      }
    }
  }
  for (int i = 0; i < MT; ++i) store8(g.y + (m0 + i) * g.N + n0, facc[i], nvalid);
}

constexpr int kA8Rows256 = 4;
constexpr int kFRows256 = 2;

template <int MT>
T256 void a8_rows_avx2(const Gemm& g, int64_t n0, int nvalid, int64_t m0, int64_t mt, Scales8& sc) {
  if constexpr (MT > 1) {
    if (mt < MT) return a8_rows_avx2<MT - 1>(g, n0, nvalid, m0, mt, sc);
  }
  a8_tile_avx2<MT>(g, n0, nvalid, m0, sc);
}

template <int MT>
T256 void f_rows_avx2(const Gemm& g, int64_t n0, int nvalid, int64_t m0, int64_t mt, Scales8& sc) {
  if constexpr (MT > 1) {
    if (mt < MT) return f_rows_avx2<MT - 1>(g, n0, nvalid, m0, mt, sc);
  }
  f_tile_avx2<MT>(g, n0, nvalid, m0, sc);
}

T256 void a8_avx2(const Gemm& g, int64_t t0, int64_t t1) {
  Scales8 sc;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = 8 * t;
    const int nvalid = int(std::min<int64_t>(8, g.N - n0));
    scales8_init(sc, g, n0, nvalid);
    sc.pf.set(g, n0 + 8 * kPrefetchTiles, std::min(g.N, 8 * t1));
    for (int64_t m0 = 0; m0 < g.M; m0 += kA8Rows256)
      a8_rows_avx2<kA8Rows256>(g, n0, nvalid, m0, std::min<int64_t>(kA8Rows256, g.M - m0), sc);
  }
}

T256 void f_avx2(const Gemm& g, int64_t t0, int64_t t1) {
  Scales8 sc;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = 8 * t;
    const int nvalid = int(std::min<int64_t>(8, g.N - n0));
    scales8_init(sc, g, n0, nvalid);
    sc.pf.set(g, n0 + 8 * kPrefetchTiles, std::min(g.N, 8 * t1));
    for (int64_t m0 = 0; m0 < g.M; m0 += kFRows256)
      f_rows_avx2<kFRows256>(g, n0, nvalid, m0, std::min<int64_t>(kFRows256, g.M - m0), sc);
  }
}

#endif  // DSV4_X86

// ------------------------------------------------------------------------------ dispatch
using namespace dsv4_isa;

// The ISAs this CPU runs, as a bit mask (bit i: isa i).
int64_t cpu_isas() {
  int64_t mask = 0;
  for (int64_t i = kScalar; i <= kAmx; ++i)
    if (cpu_has(i)) mask |= int64_t(1) << i;
  return mask;
}

Gemm gemm_of(const at::Tensor& packed, const at::Tensor& scale, int64_t M, int64_t isa, at::Tensor& y) {
  TORCH_CHECK(packed.dim() == 2 && scale.dim() == 2 && packed.scalar_type() == at::kByte &&
              scale.scalar_type() == at::kByte, "dsv4_fp4: packed and scale must be 2-D uint8");
  TORCH_CHECK(packed.device().is_cpu() && scale.device().is_cpu(), "dsv4_fp4: CPU tensors only");
  const int64_t N = packed.size(0), K = 2 * packed.size(1);
  TORCH_CHECK(K % kBlock == 0 && scale.size(0) == N && scale.size(1) == K / kBlock,
              "dsv4_fp4: packed ", packed.sizes(), " and scale ", scale.sizes(), " do not match");
  TORCH_CHECK((packed.size(1) <= 1 || packed.stride(1) == 1) && (scale.size(1) <= 1 || scale.stride(1) == 1),
              "dsv4_fp4: packed and scale need contiguous rows");
  TORCH_CHECK(isa >= kScalar && isa <= kAmx && cpu_has(isa), "dsv4_fp4: this CPU cannot run isa ", isa);
  y = at::empty({M, N}, at::TensorOptions().dtype(at::kFloat));
  Gemm g{packed.data_ptr<uint8_t>(), packed.stride(0), scale.data_ptr<uint8_t>(), scale.stride(0),
         M, N, K, K / kBlock, y.data_ptr<float>()};
  return g;
}

void run(const Gemm& g, int64_t isa, bool a8) {
  if (g.M == 0 || g.N == 0) return;
  if (isa == kAmx) isa = kAvx512;  // linear_f, and linear_a8 below kAmxRows rows
  const int64_t rows = isa == kAvx512 ? 16 : isa == kAvx2 ? 8 : 1;
  const int64_t tiles = (g.N + rows - 1) / rows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
#if DSV4_X86
    if (isa == kAvx512) return a8 ? a8_avx512(g, t0, t1) : f_avx512(g, t0, t1);
    if (isa == kAvx2) return a8 ? a8_avx2(g, t0, t1) : f_avx2(g, t0, t1);
#endif
    a8 ? a8_scalar(g, t0, t1) : f_scalar(g, t0, t1);
  });
}

// xq int8 [M, K], xs float32 [M] (or [M, 1]), packed uint8 [N, K/2], scale uint8 [N, K/32]
// -> float32 [M, N]
at::Tensor linear_a8(const at::Tensor& xq_, const at::Tensor& xs_, const at::Tensor& packed,
                     const at::Tensor& scale, int64_t isa) {
  TORCH_CHECK(xq_.dim() == 2 && xq_.scalar_type() == at::kChar, "dsv4_fp4: xq must be 2-D int8");
  TORCH_CHECK(xs_.scalar_type() == at::kFloat && xs_.numel() == xq_.size(0), "dsv4_fp4: xs must be float32 [M, 1]");
  const int64_t M = xq_.size(0);
  at::Tensor y;
  Gemm g = gemm_of(packed, scale, M, isa, y);
  TORCH_CHECK(xq_.size(1) == g.K, "dsv4_fp4: xq has ", xq_.size(1), " columns, the weight ", g.K);
  const at::Tensor xq = xq_.contiguous(), xs = xs_.contiguous();
  g.xs = xs.data_ptr<float>();
#if DSV4_AMX
  if (isa == kAmx && M >= kAmxRows && g.N > 0) {
    const int64_t Mp = (M + 15) / 16 * 16;  // x block-major, [B, Mp, 32], padded rows zero: one copy
    const at::Tensor xb = at::zeros({g.B, Mp, kBlock}, xq.options());
    xb.narrow(1, 0, M).copy_(xq.view({M, g.B, kBlock}).permute({1, 0, 2}));
    const int8_t* x = xb.data_ptr<int8_t>();
    at::parallel_for(0, (g.N + 31) / 32, 1, [&](int64_t p0, int64_t p1) { a8_amx(g, x, Mp, p0, p1); });
    return y;
  }
#endif
  const int64_t groups = (g.B + 3) / 4, K = g.K, B = g.B;
  g.xstride = 128 * groups;
  g.nstride = 16 * groups;
  at::Tensor xg = at::zeros({M, g.xstride}, at::TensorOptions().dtype(at::kChar));
  at::Tensor nxs = at::zeros({M, g.nstride}, at::TensorOptions().dtype(at::kInt));
  const int8_t* src = xq.data_ptr<int8_t>();
  int8_t* dst = xg.data_ptr<int8_t>();
  int32_t* sums = nxs.data_ptr<int32_t>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < B; ++b) {
        const int8_t* s = src + m * K + b * kBlock;
        int8_t* d = dst + m * g.xstride + xoff(b);
        int32_t sum = 0;
        for (int j = 0; j < kBlockBytes; ++j) {
          d[j] = s[2 * j];
          d[64 + j] = s[2 * j + 1];
          sum += int32_t(s[2 * j]) + int32_t(s[2 * j + 1]);
        }
        sums[m * g.nstride + noff(b)] = -kOffset * sum;
      }
  });
  g.xg = dst;
  g.nxs = sums;
  run(g, isa, true);
  return y;
}

// x float32 [M, K], packed uint8 [N, K/2], scale uint8 [N, K/32] -> float32 [M, N]
at::Tensor linear_f(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale, int64_t isa) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "dsv4_fp4: x must be 2-D float32");
  at::Tensor y;
  Gemm g = gemm_of(packed, scale, x_.size(0), isa, y);
  TORCH_CHECK(x_.size(1) == g.K, "dsv4_fp4: x has ", x_.size(1), " columns, the weight ", g.K);
  const at::Tensor x = x_.contiguous();
  g.xf = x.data_ptr<float>();
  run(g, isa, false);
  return y;
}

}  // namespace

namespace dsv4_isa {

bool cpu_has(int64_t isa) {
  if (isa == kScalar) return true;
#if DSV4_X86
  __builtin_cpu_init();
  switch (isa) {
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma");
    case kAmx: {  // the AVX-512 path's features, AMX's, and the kernel's leave to use the tiles
#if DSV4_AMX
      static const bool ok = cpu_has(kAvx512) && __builtin_cpu_supports("amx-tile") &&
                             __builtin_cpu_supports("amx-int8") && amx_permitted();
      return ok;
#else
      return false;
#endif
    }
    default: return false;
  }
#else
  return false;
#endif
}

}  // namespace dsv4_isa

TORCH_LIBRARY(dsv4_fp4, m) {
  m.def("linear_a8(Tensor xq, Tensor xs, Tensor packed, Tensor scale, int isa) -> Tensor");
  m.def("linear_f(Tensor x, Tensor packed, Tensor scale, int isa) -> Tensor");
  m.def("cpu_isas() -> int", &cpu_isas);
}

TORCH_LIBRARY_IMPL(dsv4_fp4, CPU, m) {
  m.impl("linear_a8", &linear_a8);
  m.impl("linear_f", &linear_f);
}

// The head's product from its stored bfloat16 weight with float32 activations, exactly as a
// float32 GEMM would take it: y[M, N] = x[M, K] @ float32(w[N, K]).T, each weight widened
// (exact) as it is read, so the model multiplies the checkpoint's values while reading half
// the bytes of a float32 copy. Called through torch.ops.dsv4_fp4.linear_bf16
// (dsv4/model/fp4_kernel.py owns the Python side and the torch fallback).
//
// One order of operations for every output, whatever M, the tiling, the thread count or the
// path: 16 partial sums, lane j taking k = j, j + 16, j + 32, ... in order by fma (a row's
// tail padded with zeros to a multiple of 16), then s[j] + s[j + 8] (j < 8), then
// t[j] + t[j + 4] (j < 4), then (u0 + u2) + (u1 + u3). Every path gives the same bits, and a
// row's result does not depend on the rows batched with it (MTP on = off, T = 2 = T = 1).
//
// Paths (isa codes of cpu_isa.h): AVX-512 (kAvx512 and kAmx) tiles of 4 x rows x 4 weight
// rows, one zmm a 16-lane sum; AVX2 + FMA tiles of 2 x 2, two ymm a sum; scalar (fmaf).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace dsv4_isa;

constexpr int kLanes = 16;
constexpr int64_t kTileN = 4;    // weight rows a task takes (the widest path's tile)
constexpr int64_t kBlockM = 64;  // x rows whose float32 rows stay in L2 while the weights stream

struct Args {
  const float* x;     // [M, K], row stride xs
  int64_t xs;
  const uint16_t* w;  // [N, K] bfloat16 bits, row stride ws
  int64_t ws;
  float* y;           // [M, N] contiguous
  int64_t M, N, K;
};

inline float reduce16(const float* s) {
  float t[8], u[4];
  for (int j = 0; j < 8; ++j) t[j] = s[j] + s[j + 8];
  for (int j = 0; j < 4; ++j) u[j] = t[j] + t[j + 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// ------------------------------------------------------------------------------ scalar
void rows_scalar(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  const int64_t Kp = (a.K + kLanes - 1) / kLanes * kLanes;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t m = m0; m < m1; ++m) {
      const float* x = a.x + m * a.xs;
      const uint16_t* w = a.w + n * a.ws;
      float s[kLanes] = {};
      for (int64_t k0 = 0; k0 < Kp; k0 += kLanes)
        for (int j = 0; j < kLanes; ++j) {
          const int64_t k = k0 + j;
          s[j] = std::fma(k < a.K ? x[k] : 0.f, k < a.K ? widen_bf16(w[k]) : 0.f, s[j]);
        }
      a.y[m * a.N + n] = reduce16(s);
    }
}

#if defined(__x86_64__)
// A row's last K % 16 elements, zero padded (x as float32, w as its bfloat16 bits).
struct Tail {
  alignas(64) float x[kLanes];
  alignas(64) uint16_t w[kLanes];
};

// The rows of x and of w a tile of MR x NR outputs at (m0, n0) reads.
template <int MR, int NR>
inline void tile_rows(const Args& a, int64_t m0, int64_t n0, const float* (&x)[MR], const uint16_t* (&w)[NR]) {
  for (int i = 0; i < MR; ++i) x[i] = a.x + (m0 + i) * a.xs;
  for (int r = 0; r < NR; ++r) w[r] = a.w + (n0 + r) * a.ws;
}

inline void tail_of(const float* x, const uint16_t* w, int64_t k, int64_t K, Tail& t) {
  std::memset(&t, 0, sizeof t);
  std::memcpy(t.x, x + k, (K - k) * sizeof(float));
  std::memcpy(t.w, w + k, (K - k) * sizeof(uint16_t));
}

// ------------------------------------------------------------------------------ AVX-512
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

T512 inline __m512 widen16(const uint16_t* w) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

T512 inline float reduce512(__m512 s) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));  // lanes 8-15
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(s), high);                      // s[j] + s[j + 8]
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));  // t[j] + t[j + 4]
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));                                   // u0 + u2, u1 + u3
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

template <int MR, int NR>
T512 void tile_avx512(const Args& a, int64_t m0, int64_t n0) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
  const float* x[MR];
  const uint16_t* w[NR];
  tile_rows(a, m0, n0, x, w);
  int64_t k = 0;
  for (; k + kLanes <= a.K; k += kLanes) {
    __m512 wv[NR];
    for (int r = 0; r < NR; ++r) wv[r] = widen16(w[r] + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(x[i] + k);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_fmadd_ps(xv, wv[r], acc[i][r]);
    }
  }
  if (k < a.K) {
    Tail t[MR][NR];
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) {
        tail_of(x[i], w[r], k, a.K, t[i][r]);
        acc[i][r] = _mm512_fmadd_ps(_mm512_load_ps(t[i][r].x), widen16(t[i][r].w), acc[i][r]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) a.y[(m0 + i) * a.N + n0 + r] = reduce512(acc[i][r]);
}

// ------------------------------------------------------------------------------ AVX2
#define T256 __attribute__((target("avx2,fma")))

T256 inline __m256 widen8(const uint16_t* w) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

T256 inline float reduce256(__m256 lo, __m256 hi) {  // lanes 0-7 in lo, 8-15 in hi
  const __m256 t = _mm256_add_ps(lo, hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

template <int MR, int NR>
T256 void tile_avx2(const Args& a, int64_t m0, int64_t n0) {
  __m256 lo[MR][NR], hi[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) lo[i][r] = hi[i][r] = _mm256_setzero_ps();
  const float* x[MR];
  const uint16_t* w[NR];
  tile_rows(a, m0, n0, x, w);
  int64_t k = 0;
  for (; k + kLanes <= a.K; k += kLanes) {
    __m256 wl[NR], wh[NR];
    for (int r = 0; r < NR; ++r) wl[r] = widen8(w[r] + k), wh[r] = widen8(w[r] + k + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 xl = _mm256_loadu_ps(x[i] + k), xh = _mm256_loadu_ps(x[i] + k + 8);
      for (int r = 0; r < NR; ++r) {
        lo[i][r] = _mm256_fmadd_ps(xl, wl[r], lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(xh, wh[r], hi[i][r]);
      }
    }
  }
  if (k < a.K) {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < NR; ++r) {
        Tail t;
        tail_of(x[i], w[r], k, a.K, t);
        lo[i][r] = _mm256_fmadd_ps(_mm256_load_ps(t.x), widen8(t.w), lo[i][r]);
        hi[i][r] = _mm256_fmadd_ps(_mm256_load_ps(t.x + 8), widen8(t.w + 8), hi[i][r]);
      }
  }
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < NR; ++r) a.y[(m0 + i) * a.N + n0 + r] = reduce256(lo[i][r], hi[i][r]);
}

struct Avx512 {
  static constexpr int kM = 4, kN = 4;
  template <int MR, int NR> static void tile(const Args& a, int64_t m, int64_t n) { tile_avx512<MR, NR>(a, m, n); }
};

struct Avx2 {
  static constexpr int kM = 2, kN = 2;
  template <int MR, int NR> static void tile(const Args& a, int64_t m, int64_t n) { tile_avx2<MR, NR>(a, m, n); }
};

// Rows [m0, m1) x [n0, n1) in P's tiles of P::kM x P::kN, single rows and columns at the edges.
template <typename P>
void tiles(const Args& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + P::kN <= n1; n += P::kN) {
    int64_t m = m0;
    for (; m + P::kM <= m1; m += P::kM) P::template tile<P::kM, P::kN>(a, m, n);
    for (; m < m1; ++m) P::template tile<1, P::kN>(a, m, n);
  }
  for (; n < n1; ++n) {
    int64_t m = m0;
    for (; m + P::kM <= m1; m += P::kM) P::template tile<P::kM, 1>(a, m, n);
    for (; m < m1; ++m) P::template tile<1, 1>(a, m, n);
  }
}
#endif  // __x86_64__

void rows(const Args& a, int64_t isa, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
#if defined(__x86_64__)
  if (isa >= kAvx512) return tiles<Avx512>(a, m0, m1, n0, n1);
  if (isa == kAvx2) return tiles<Avx2>(a, m0, m1, n0, n1);
#endif
  rows_scalar(a, m0, m1, n0, n1);
}

// x float32 [M, K] (rows contiguous), w bfloat16 [N, K] (rows contiguous) -> float32 [M, N]
at::Tensor linear_bf16(const at::Tensor& x_, const at::Tensor& w, int64_t isa) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat, "dsv4_fp4: x must be 2-D float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "dsv4_fp4: w must be 2-D bfloat16");
  TORCH_CHECK(x_.device().is_cpu() && w.device().is_cpu(), "dsv4_fp4: CPU tensors only");
  TORCH_CHECK(x_.size(1) == w.size(1), "dsv4_fp4: x has ", x_.size(1), " columns, the weight ", w.size(1));
  TORCH_CHECK(w.size(1) <= 1 || w.stride(1) == 1, "dsv4_fp4: the weight needs contiguous rows");
  TORCH_CHECK(isa >= kScalar && isa <= kAmx && cpu_has(isa), "dsv4_fp4: this CPU cannot run isa ", isa);
  const at::Tensor x = x_.stride(1) == 1 || x_.size(1) <= 1 ? x_ : x_.contiguous();
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, at::TensorOptions().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  const Args a{x.data_ptr<float>(), x.stride(0), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
               w.stride(0), y.data_ptr<float>(), M, N, K};
  if (K == 0) return y.zero_();
  const int64_t tasks = (N + kTileN - 1) / kTileN;
  for (int64_t m0 = 0; m0 < M; m0 += kBlockM) {
    const int64_t m1 = std::min(M, m0 + kBlockM);
    at::parallel_for(0, tasks, 16, [&](int64_t t0, int64_t t1) {
      rows(a, isa, m0, m1, t0 * kTileN, std::min(N, t1 * kTileN));
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv4_fp4, m) {
  m.def("linear_bf16(Tensor x, Tensor w, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(dsv4_fp4, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
}

// A weight quantised to int8 rows while it loads, in one pass over the stored bytes and
// straight into the model's storage: q[r, c] = round_half_even(v[r, c] / s[r]) clamped to
// +-127, s[r] = max(amax_c |v[r, c]|, tiny) / qmax, where v is the stored value widened to
// float32: an FP8 e4m3 byte through `lut` (float32 [256], torch's own conversion) times its
// 128 x 128 block's float32 scale, a bfloat16 widened, or a float32 as is. Every operation is
// one IEEE float32 operation, as in the torch code it replaces (quant.dequantize_fp8, then
// kernels.quantize_rows), so every path gives that code's bits. A NaN anywhere in a row makes
// its scale NaN (the loader's finiteness check names the tensor). Called through
// torch.ops.dsv4_fp4.rows_int8_ (dsv4/model/int8_rows.py owns the Python side).
//
// Paths (isa codes of cpu_isa.h): the division, rounding and narrowing in AVX-512 (kAvx512,
// kAmx) or AVX2 (kAvx2), else scalar; the widening and the row maximum are scalar loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using namespace dsv4_isa;

constexpr int64_t kFp8Block = 128;

enum Kind { kFp8, kBf16, kF32 };

struct Rows {
  Kind kind;
  const uint8_t* u8;    // FP8 bytes [R, C], row stride rs (elements)
  const uint16_t* b16;  // bfloat16 bits
  const float* f32;
  int64_t rs;
  const float* lut;     // FP8: byte -> float32
  const float* bscale;  // FP8: float32 [ceil(R / 128), bcols]
  int64_t bcols;
  int8_t* q;            // [R, C], row stride qs
  int64_t qs;
  float* s;             // [R]
  int64_t C;
  float tiny, qmax;
};

// Row r as float32 into v[C]; returns the largest |v| (NaN if any v is NaN).
float decode(const Rows& a, int64_t r, float* v) {
  if (a.kind == kFp8) {
    const uint8_t* src = a.u8 + r * a.rs;
    const float* bs = a.bscale + (r / kFp8Block) * a.bcols;
    for (int64_t c0 = 0; c0 < a.C; c0 += kFp8Block) {
      const float sc = bs[c0 / kFp8Block];
      const int64_t c1 = std::min(a.C, c0 + kFp8Block);
      for (int64_t c = c0; c < c1; ++c) v[c] = a.lut[src[c]] * sc;
    }
  } else if (a.kind == kBf16) {
    const uint16_t* src = a.b16 + r * a.rs;
    for (int64_t c = 0; c < a.C; ++c) v[c] = widen_bf16(src[c]);
  } else {
    std::memcpy(v, a.f32 + r * a.rs, a.C * sizeof(float));
  }
  float m = 0.f;
  bool nan = false;
  for (int64_t c = 0; c < a.C; ++c) {
    const float x = std::fabs(v[c]);
    nan |= x != x;
    m = x > m ? x : m;
  }
  return nan ? NAN : m;
}

// round half to even (the default rounding mode), clamp; a NaN (its row's scale is NaN and
// the row is refused) gives 0 rather than an undefined conversion
inline int8_t narrow(float y, float qmax) {
  if (y != y) return 0;
  y = std::nearbyint(y);
  y = y < -qmax ? -qmax : (y > qmax ? qmax : y);
  return static_cast<int8_t>(static_cast<int32_t>(y));
}

void quantize_scalar(const float* v, float s, int8_t* q, int64_t C, float qmax) {
  for (int64_t c = 0; c < C; ++c) q[c] = narrow(v[c] / s, qmax);
}

#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_avx512(const float* v, float s, int8_t* q, int64_t C, float qmax) {
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  int64_t c = 0;
  for (; c + 16 <= C; c += 16) {
    __m512 y = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(v + c), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    y = _mm512_min_ps(_mm512_max_ps(y, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + c), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(y)));
  }
  quantize_scalar(v + c, s, q + c, C - c, qmax);
}

__attribute__((target("avx2,fma")))
void quantize_avx2(const float* v, float s, int8_t* q, int64_t C, float qmax) {
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(qmax), lo = _mm256_set1_ps(-qmax);
  int64_t c = 0;
  for (; c + 8 <= C; c += 8) {
    __m256 y = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(v + c), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    y = _mm256_min_ps(_mm256_max_ps(y, lo), hi);
    const __m256i i = _mm256_cvtps_epi32(y);                                    // 8 x int32 in [-127, 127]
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + c), _mm_packs_epi16(w, w));
  }
  quantize_scalar(v + c, s, q + c, C - c, qmax);
}
#endif

void quantize(int64_t isa, const float* v, float s, int8_t* q, int64_t C, float qmax) {
#if defined(__x86_64__)
  if (isa >= kAvx512) return quantize_avx512(v, s, q, C, qmax);
  if (isa == kAvx2) return quantize_avx2(v, s, q, C, qmax);
#endif
  quantize_scalar(v, s, q, C, qmax);
}

// src [R, C] (uint8 FP8 bytes with lut and bscale, bfloat16 or float32; rows contiguous)
// -> q int8 [R, C] (rows contiguous), s float32 [R] (contiguous), written in place.
void rows_int8_(const at::Tensor& src, const at::Tensor& lut, const at::Tensor& bscale, const at::Tensor& q,
                const at::Tensor& s, double tiny, double qmax, int64_t isa) {
  TORCH_CHECK(src.dim() == 2 && q.dim() == 2 && s.dim() == 1, "dsv4 rows_int8: src and q must be 2-D, s 1-D");
  TORCH_CHECK(q.sizes() == src.sizes() && s.size(0) == src.size(0), "dsv4 rows_int8: q ", q.sizes(), ", s ",
              s.sizes(), " do not match src ", src.sizes());
  TORCH_CHECK(q.scalar_type() == at::kChar && s.scalar_type() == at::kFloat, "dsv4 rows_int8: q int8, s float32");
  const int64_t R = src.size(0), C = src.size(1);
  TORCH_CHECK(C <= 1 || (src.stride(1) == 1 && q.stride(1) == 1), "dsv4 rows_int8: rows must be contiguous");
  TORCH_CHECK(R <= 1 || s.stride(0) == 1, "dsv4 rows_int8: s must be contiguous");
  Rows a{};
  a.rs = src.stride(0);
  a.q = q.data_ptr<int8_t>();
  a.qs = q.stride(0);
  a.s = s.data_ptr<float>();
  a.C = C;
  a.tiny = static_cast<float>(tiny);
  a.qmax = static_cast<float>(qmax);
  switch (src.scalar_type()) {
    case at::kByte:
      TORCH_CHECK(lut.scalar_type() == at::kFloat && lut.numel() == 256 && lut.is_contiguous(),
                  "dsv4 rows_int8: FP8 needs a float32 [256] lut");
      TORCH_CHECK(bscale.scalar_type() == at::kFloat && bscale.dim() == 2 && bscale.is_contiguous() &&
                      bscale.size(0) == (R + kFp8Block - 1) / kFp8Block &&
                      bscale.size(1) == (C + kFp8Block - 1) / kFp8Block,
                  "dsv4 rows_int8: FP8 block scales must be float32 [ceil(R/128), ceil(C/128)], got ", bscale.sizes());
      a.kind = kFp8;
      a.u8 = src.data_ptr<uint8_t>();
      a.lut = lut.data_ptr<float>();
      a.bscale = bscale.data_ptr<float>();
      a.bcols = bscale.size(1);
      break;
    case at::kBFloat16:
      a.kind = kBf16;
      a.b16 = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>());
      break;
    case at::kFloat:
      a.kind = kF32;
      a.f32 = src.data_ptr<float>();
      break;
    default:
      TORCH_CHECK(false, "dsv4 rows_int8: src must be uint8 (FP8 bytes), bfloat16 or float32, got ", src.scalar_type());
  }
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> v(static_cast<size_t>(std::max<int64_t>(C, 1)));
    for (int64_t r = r0; r < r1; ++r) {
      const float m = decode(a, r, v.data());
      const float sc = (m < a.tiny ? a.tiny : m) / a.qmax;  // NaN stays NaN, as in torch's clamp_min
      a.s[r] = sc;
      quantize(isa, v.data(), sc, a.q + r * a.qs, C, a.qmax);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dsv4_fp4, m) {
  m.def("rows_int8_(Tensor src, Tensor lut, Tensor bscale, Tensor(a!) q, Tensor(b!) s, float tiny, float qmax, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(dsv4_fp4, CPU, m) {
  m.impl("rows_int8_", &rows_int8_);
}

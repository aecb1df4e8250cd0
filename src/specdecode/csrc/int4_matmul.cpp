// Per-token int8 activations times 4-bit grouped weights (the layout of GGUF's Q4_K), AVX-512 VNNI.
//
// The format and the arithmetic are defined in specdecode/runners/int4.py (module glossary);
// this file computes exactly the same numbers as its pure-torch reference:
//   a[t,k]    = clamp(round_half_even(x[t,k] / ascale[t]), -127, 127),
//               ascale[t] = max(max_k |x[t,k]|, 2^-100) / 127            (float32 division)
//   P[t,o,s]  = sum_{g in s} sc[o,g] * sum_{k in g} q[o,k] * a[t,k]    (exact, int32)
//   Q[t,o,s]  = sum_{g in s} m[o,g] * sum_{k in g} a[t,k]              (exact, int32)
//   y[t,o]    = (... ((0 + (float(P_0) * d_0 - float(Q_0) * dmin_0)) + (float(P_1) * d_1 - ...)) ...)
//               * ascale[t] [+ bias[o]]      (float32, super-blocks in order, no fused operations)
// Codes q in [0, 15] go to VPDPBUSD (unsigned bytes times signed bytes) directly. Each group keeps
// two chains per token, over the low and the high nibbles, of 16 inputs each: |sum| <= 16 * 15 *
// 127 = 30480 fits int16, so the two land in the halves of each 32-bit lane and one VPDPWSSD
// multiplies both by sc and adds them to P. Q comes from the group sums of a, paired the same way
// against the mins of two groups.
//
// Packed layout, per block of 16 output rows: per group of 32 inputs, 256 code bytes in four
// 64-byte chunks m = 0..3, byte lane*4+i of chunk m holding row (block*16 + lane) at input
// k = g*32 + m*8 + i in its low nibble and at k = g*32 + m*8 + 4 + i in its high nibble; 16 scale
// bytes, one per row; per pair of groups 32 min bytes, row lane's at 2*lane (even group) and
// 2*lane + 1; per super-block of 8 groups, 16 float32 d then 16 float32 dmin.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t GROUPS_PER_SUPER = 8;
constexpr int64_t ROWS = 16;
constexpr int64_t BLOCK_BYTES = 256;
constexpr int64_t MAX_TOKENS = 8;  // tokens that share one pass over a row block's weights
// Weights stream from memory once a pass; the hardware prefetcher alone left the two cores at
// about 15 GB/s of the 23 they can read, so each group asks for the code bytes L1_AHEAD bytes on
// into L1 and L2_AHEAD bytes on into L2 (a prefetch past the end of the tensor is harmless).
constexpr int64_t L1_AHEAD = 2048, L2_AHEAD = 8192;

// One token's quantisation: int8 values into a (padded with zeros to groups * 32) and the
// group sums, two groups to an int32 (even group in the low half), into pairs; returns ascale.
float quantize_token(const float* x, int64_t in, int64_t groups, int8_t* a, int32_t* pairs) {
  float amax = 0.0f;
  for (int64_t k = 0; k < in; ++k) {
    float v = x[k] < 0 ? -x[k] : x[k];
    amax = v > amax ? v : amax;
  }
  if (!(amax >= 0x1p-100f)) amax = 0x1p-100f;
  const float ascale = amax / 127.0f;
  for (int64_t k = 0; k < in; ++k) {
    float r = std::nearbyint(x[k] / ascale);  // the default rounding mode: half to even
    r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
    a[k] = static_cast<int8_t>(r);
  }
  for (int64_t k = in; k < groups * GROUP; ++k) a[k] = 0;
  for (int64_t p = 0; p < groups / 2; ++p) {
    int32_t even = 0, odd = 0;
    for (int64_t k = 0; k < GROUP; ++k) {
      even += a[(2 * p) * GROUP + k];
      odd += a[(2 * p + 1) * GROUP + k];
    }
    pairs[p] = static_cast<int32_t>((static_cast<uint32_t>(odd) << 16) | (static_cast<uint32_t>(even) & 0xFFFFu));
  }
  return ascale;
}

void prefetch_ahead(const uint8_t* codes, const uint8_t* scales, int64_t g) {
  for (int64_t line = 0; line < BLOCK_BYTES; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + L1_AHEAD + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(codes + L2_AHEAD + line), _MM_HINT_T1);
  }
  if ((g & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(scales + L1_AHEAD / (BLOCK_BYTES / ROWS)), _MM_HINT_T0);
}

// y[t] (16 rows each, before the token's ascale) for T tokens over one row block.
template <int T>
void block_dot(const uint8_t* codes, const uint8_t* scales, const uint8_t* mins, const float* superscales,
               int64_t supers, const int8_t* a, const int32_t* pairs, int64_t a_stride, int64_t p_stride, __m512* y) {
  for (int t = 0; t < T; ++t) y[t] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t s = 0; s < supers; ++s) {
    __m512i p_acc[T];
    for (int t = 0; t < T; ++t) p_acc[t] = _mm512_setzero_si512();
    for (int64_t g = s * GROUPS_PER_SUPER; g < (s + 1) * GROUPS_PER_SUPER; ++g) {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * ROWS)));
      const __m512i sc2 = _mm512_or_si512(sc, _mm512_slli_epi32(sc, 16));  // sc in both halves of a lane
      __m512i group_lo[T], group_hi[T];
      for (int t = 0; t < T; ++t) group_lo[t] = group_hi[t] = _mm512_setzero_si512();
      const uint8_t* w = codes + g * BLOCK_BYTES;
      prefetch_ahead(w, scales + g * ROWS, g);
      const int8_t* ag = a + g * GROUP;
      for (int m = 0; m < 4; ++m) {
        const __m512i v = _mm512_loadu_si512(w + m * 64);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int t = 0; t < T; ++t) {
          const int8_t* at = ag + t * a_stride + m * 8;
          int32_t a0, a1;
          std::memcpy(&a0, at, 4);
          std::memcpy(&a1, at + 4, 4);
          group_lo[t] = _mm512_dpbusd_epi32(group_lo[t], lo, _mm512_set1_epi32(a0));
          group_hi[t] = _mm512_dpbusd_epi32(group_hi[t], hi, _mm512_set1_epi32(a1));
        }
      }
      for (int t = 0; t < T; ++t) {
        const __m512i halves = _mm512_mask_blend_epi16(0xAAAAAAAAu, group_lo[t], _mm512_slli_epi32(group_hi[t], 16));
        p_acc[t] = _mm512_dpwssd_epi32(p_acc[t], halves, sc2);
      }
    }
    __m512i m2[GROUPS_PER_SUPER / 2];
    for (int pr = 0; pr < GROUPS_PER_SUPER / 2; ++pr)
      m2[pr] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(mins + (s * GROUPS_PER_SUPER / 2 + pr) * 2 * ROWS)));
    const __m512 d = _mm512_loadu_ps(superscales + s * 2 * ROWS);
    const __m512 dmin = _mm512_loadu_ps(superscales + s * 2 * ROWS + ROWS);
    for (int t = 0; t < T; ++t) {
      __m512i q_acc = _mm512_setzero_si512();
      for (int pr = 0; pr < GROUPS_PER_SUPER / 2; ++pr)
        q_acc = _mm512_dpwssd_epi32(q_acc, m2[pr], _mm512_set1_epi32(pairs[t * p_stride + s * GROUPS_PER_SUPER / 2 + pr]));
      const __m512 hi_part = _mm512_mul_ps(_mm512_cvtepi32_ps(p_acc[t]), d);
      const __m512 lo_part = _mm512_mul_ps(_mm512_cvtepi32_ps(q_acc), dmin);
      y[t] = _mm512_add_ps(y[t], _mm512_sub_ps(hi_part, lo_part));
    }
  }
}

using BlockDot = void (*)(const uint8_t*, const uint8_t*, const uint8_t*, const float*, int64_t, const int8_t*,
                          const int32_t*, int64_t, int64_t, __m512*);
const BlockDot BLOCK_DOTS[MAX_TOKENS + 1] = {nullptr, block_dot<1>, block_dot<2>, block_dot<3>, block_dot<4>,
                                             block_dot<5>, block_dot<6>, block_dot<7>, block_dot<8>};

void check(const torch::Tensor& t, at::ScalarType type, int64_t dims, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", c10::toString(type), ", got ", c10::toString(t.scalar_type()));
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous CPU tensor");
}

}  // namespace

// x float32 [M, in]; codes uint8 [blocks, groups, 256]; scales uint8 [blocks, groups, 16]; mins uint8
// [blocks, groups / 2, 32]; superscales float32 [blocks, groups / 8, 2, 16]; out rows; bias float32
// [out] or empty -> float32 [M, out]
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                          const torch::Tensor& mins, const torch::Tensor& superscales, int64_t out,
                          const torch::Tensor& bias) {
  check(x, at::kFloat, 2, "x");
  check(codes, at::kByte, 3, "codes");
  check(scales, at::kByte, 3, "scales");
  check(mins, at::kByte, 3, "mins");
  check(superscales, at::kFloat, 4, "superscales");
  const int64_t tokens = x.size(0), in = x.size(1);
  const int64_t blocks = codes.size(0), groups = codes.size(1), supers = groups / GROUPS_PER_SUPER;
  TORCH_CHECK(codes.size(2) == BLOCK_BYTES && groups % GROUPS_PER_SUPER == 0 && scales.size(0) == blocks &&
                  scales.size(1) == groups && scales.size(2) == ROWS && mins.size(0) == blocks &&
                  mins.size(1) == groups / 2 && mins.size(2) == 2 * ROWS && superscales.size(0) == blocks &&
                  superscales.size(1) == supers && superscales.size(2) == 2 && superscales.size(3) == ROWS,
              "codes, scales, mins and superscales do not match the packed layout");
  TORCH_CHECK(supers == (in + GROUP * GROUPS_PER_SUPER - 1) / (GROUP * GROUPS_PER_SUPER), "x has ", in,
              " inputs where the weights have ", groups, " groups");
  TORCH_CHECK(blocks * ROWS >= out && blocks * ROWS < out + ROWS, "out is ", out, " rows for ", blocks, " row blocks");
  const bool has_bias = bias.numel() > 0;
  if (has_bias) {
    check(bias, at::kFloat, 1, "bias");
    TORCH_CHECK(bias.size(0) == out, "bias has ", bias.size(0), " rows where the weights have ", out);
  }
  auto y = torch::empty({tokens, out}, x.options());
  if (tokens == 0 || out == 0) return y;

  const int64_t padded = groups * GROUP;
  std::vector<int8_t> a(tokens * padded);
  std::vector<int32_t> pairs(tokens * (groups / 2));
  std::vector<float> ascale(tokens);
  const float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    ascale[t] = quantize_token(xp + t * in, in, groups, a.data() + t * padded, pairs.data() + t * (groups / 2));

  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const uint8_t* mp = mins.data_ptr<uint8_t>();
  const float* fp = superscales.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, groups));  // row blocks per task, at least
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    __m512 acc[MAX_TOKENS];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t row0 = block * ROWS, rows = std::min<int64_t>(ROWS, out - row0);
      const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
      const __m512 b = has_bias ? _mm512_maskz_loadu_ps(mask, bp + row0) : _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < tokens; t0 += MAX_TOKENS) {
        const int count = static_cast<int>(std::min<int64_t>(MAX_TOKENS, tokens - t0));
        BLOCK_DOTS[count](cp + block * groups * BLOCK_BYTES, sp + block * groups * ROWS, mp + block * groups * ROWS,
                          fp + block * supers * 2 * ROWS, supers, a.data() + t0 * padded,
                          pairs.data() + t0 * (groups / 2), padded, groups / 2, acc);
        for (int t = 0; t < count; ++t) {
          __m512 r = _mm512_mul_ps(acc[t], _mm512_set1_ps(ascale[t0 + t]));
          if (has_bias) r = _mm512_add_ps(r, b);
          _mm512_mask_storeu_ps(yp + (t0 + t) * out + row0, mask, r);
        }
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear", &int4_linear, "per-token int8 activations times packed 4-bit weights (see int4.py)");
}

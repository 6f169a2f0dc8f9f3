// Helpers shared by the bitnest kernels; passed to mx.fast.metal_kernel as `header`.
// MLX scans only the kernel body for attribute names, so nothing here may rely on them.

// Short loops with a constant trip count are unrolled in full: their counters and index
// arithmetic then cost nothing per element (Metal's compiler is clang-based; g++ ignores it).
#define BN_UNROLL _Pragma("clang loop unroll(full)")

// Code i (0..7) of a 4-bit word, as MLX's affine packing stores it: low nibble first.
inline int bn_nibble(uint word, int i) {
  return int((word >> (4 * i)) & 0xfu);
}

// The float 2^23 + m for an integer 0 <= m < 2^23 (m ORed into the mantissa of 2^23): a code
// masked in place becomes a float without a shift or an int->float conversion.
inline float bn_magic(uint m) {
  return as_type<float>(0x4B000000u | m);
}

// v rounded to the nearest integer, ties to even, for |v| < 2^22: adding 1.5 · 2^23 leaves no
// fraction bits, so the float add rounds (as rint does); subtracting it is exact. Two adds
// instead of the rounding unit (MLX builds custom kernels without fast-math, which keeps it).
inline float bn_round_even(float v) {
  return (v + 12582912.0f) - 12582912.0f;
}

// What x's column c (of each 8) is multiplied by before it meets a code decoded in place: the
// inverse of the code's power of two in its word, 16^-(c % 4) for W4 nibbles and
// 256^-((c / 2) % 2) for W8 bytes (bn_decode_w4 / bn_decode_w8). Exact: a power of two.
inline float bn_prescale(int c, bool target) {
  if (target)
    return (c / 2) % 2 ? 1.0f / 256.0f : 1.0f;
  return 1.0f / float(1 << (4 * (c % 4)));
}

// The 8 W4 codes of word h, minus 8, each times 16^-(c % 4) (x is pre-scaled by the inverse):
// out[c] = (nibble c - 8) · 16^(c % 4), exact.
inline void bn_decode_w4(uint h, thread float* out) {
  const uint upper = h >> 16;
  out[0] = bn_magic(h & 0xFu) - 8388616.0f;  // 2^23 + 8
  out[1] = bn_magic(h & 0xF0u) - 8388736.0f;  // 2^23 + 8·16
  out[2] = bn_magic(h & 0xF00u) - 8390656.0f;  // 2^23 + 8·256
  out[3] = bn_magic(h & 0xF000u) - 8421376.0f;  // 2^23 + 8·4096
  out[4] = bn_magic(upper & 0xFu) - 8388616.0f;
  out[5] = bn_magic(upper & 0xF0u) - 8388736.0f;
  out[6] = bn_magic(upper & 0xF00u) - 8390656.0f;
  out[7] = bn_magic(upper & 0xF000u) - 8421376.0f;
}

// The 8 W8 codes 16 (hi - 8) + (lo - 8) of a word pair, given as bytes 16 hi + lo: `even` holds
// columns 0, 2, 4, 6 and `odd` columns 1, 3, 5, 7. out[c] = code · 256^((c / 2) % 2), exact.
inline void bn_decode_w8(uint even, uint odd, thread float* out) {
  const uint even_up = even >> 16;
  const uint odd_up = odd >> 16;
  out[0] = bn_magic(even & 0xFFu) - 8388744.0f;  // 2^23 + 136
  out[1] = bn_magic(odd & 0xFFu) - 8388744.0f;
  out[2] = bn_magic(even & 0xFF00u) - 8423424.0f;  // 2^23 + 136·256
  out[3] = bn_magic(odd & 0xFF00u) - 8423424.0f;
  out[4] = bn_magic(even_up & 0xFFu) - 8388744.0f;
  out[5] = bn_magic(odd_up & 0xFFu) - 8388744.0f;
  out[6] = bn_magic(even_up & 0xFF00u) - 8423424.0f;
  out[7] = bn_magic(odd_up & 0xFF00u) - 8423424.0f;
}

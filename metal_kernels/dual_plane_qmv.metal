// y[m, n] = Σ_k x[m, k] · W[n, k] for M = 1..8 tokens, straight from the nibble planes.
//   draft:  W = (hi - 8) · s          target: W = (16 (hi - 8) + (lo - 8)) · s / 16
// Template: T (y's dtype), M, TARGET, GS (weight group: 32, 64 or 128 columns per
// scale), A8 (0: x is used as it is; 1: x holds A8 codes and `ascale` their scales, as
// a8_quantize.metal writes them; 2: x is quantized here, q = rint(x / a), a = max|x| / 127),
// AG (the A8 scale's group in columns, a multiple of 16; 0: one per token; with A8 = 2 it also
// divides 512 and is a power of two in 16-column lanes), GATE_UP (the planes are [gate; up]
// stacked, and y = silu(x·gateᵀ) · (x·upᵀ)).
// A8 = 2 divides once per scale and multiplies x by the reciprocal: a code can differ from
// numerics.a8's x / a where x / a lies within an ulp of a half, which the self-test's
// tolerance covers. |x| <= max|x| keeps |q| <= 127, so numerics' clip never binds here. It
// costs each simdgroup the quantization of all M·K inputs (kernels/dual_plane.py says when).
// Column c of every 8 is then multiplied by the inverse of the power of two at which its code
// sits in the word (bn_prescale). A code is decoded without a shift or a conversion: masked
// in place and ORed into the mantissa of 2^23, minus 2^23 and the plane offset, it is the
// float code · 16^j (or · 256^j), exact; x · it is x · code exactly. With A8 every partial dot
// over a lane's 16 columns is therefore the integer q · c (|Σ| < 2^24), bit for bit.
// Layout: one simdgroup owns ROWS = 4 output rows (GATE_UP: 2 gate rows and the same 2 up
// rows); lane l takes 16 consecutive columns of every 512-column block, i.e. 2 words of each
// plane. 16 divides every GS and AG, so those 16 columns share one weight scale and one A8
// scale. A block's weights are decoded once, then used by all M tokens. Every lane runs every
// block when A8 = 2 (a lane past K takes no columns) so that an A8 group's lanes meet at its
// shuffles.
constexpr int ROWS = 4;
constexpr bool QUANTIZE = A8 == 2;
constexpr int AG_LANES = AG > 0 ? AG / 16 : 1;  // lanes sharing one A8 group's scale
constexpr int AGW = AG > 0 ? AG : 16;  // a divisor that is never used when AG = 0
constexpr int NOUT = GATE_UP ? 2 : ROWS;  // outputs per simdgroup
const int lane = int(thread_index_in_simdgroup);
const int out0 = int(thread_position_in_grid.y) * NOUT;
const int n_out = GATE_UP ? N / 2 : N;
const int words = K / 8;
const int groups = K / GS;

float acc[M][ROWS];
for (int m = 0; m < M; m++)
  for (int r = 0; r < ROWS; r++)
    acc[m][r] = 0.0f;

// A8 per token: each token's scale, given (A8 = 1) or from its max |x| over K (A8 = 2), which
// every simdgroup then reads again (M·K activations, far fewer bytes than its rows' weights).
float token_scale[M], token_inv[M];
for (int m = 0; m < M; m++) {
  float amax = 0.0f;
  if (QUANTIZE && AG == 0)
    for (int at = m * K + lane, end = at - lane + K; at < end; at += 32)
      amax = metal::max(amax, metal::abs(float(x[at])));
  amax = QUANTIZE && AG == 0 ? metal::simd_max(amax) : 0.0f;
  token_scale[m] = A8 == 1 && AG == 0 ? ascale[m] : amax == 0.0f ? 1.0f : amax / 127.0f;
  token_inv[m] = 1.0f / token_scale[m];
}
// What each of the lane's 16 columns is multiplied by before it meets its decoded code.
float pre[16];
BN_UNROLL
for (int i = 0; i < 16; i++)
  pre[i] = bn_prescale(i % 8, TARGET);

// Rows past the end (ragged last simdgroup) read the last row and are never written.
int wrow[ROWS];
for (int r = 0; r < ROWS; r++) {
  const int o = metal::min(out0 + (GATE_UP ? r % 2 : r), n_out - 1);
  wrow[r] = GATE_UP && r >= 2 ? n_out + o : o;
}

for (int b0 = 0; b0 < K; b0 += 512) {
  const int k0 = b0 + lane * 16;
  const bool live = k0 < K;
  if (!QUANTIZE && !live)
    break;  // the lanes meet at no shuffle: a lane past K is done
  const int w0 = k0 / 8;
  const int g = k0 / GS;
  float w[ROWS][16];
  float s[ROWS];
  for (int r = 0; r < ROWS && live; r++) {
    s[r] = float(scales[wrow[r] * groups + g]);
    BN_UNROLL
    for (int half_word = 0; half_word < 2; half_word++) {
      const uint h = hi[wrow[r] * words + w0 + half_word];
      if (TARGET) {
        const uint l = lo[wrow[r] * words + w0 + half_word];
        bn_decode_w8(((h & 0x0F0F0F0Fu) << 4) | (l & 0x0F0F0F0Fu),
                     (h & 0xF0F0F0F0u) | ((l >> 4) & 0x0F0F0F0Fu), &w[r][8 * half_word]);
      } else {
        bn_decode_w4(h, &w[r][8 * half_word]);
      }
    }
  }
  for (int m = 0; m < M; m++) {
    float xv[16];
    const int xrow = m * K + k0;
    BN_UNROLL
    for (int i = 0; i < 16; i++)
      xv[i] = QUANTIZE && !live ? 0.0f : float(x[xrow + i]);
    float a = token_scale[m], inv = token_inv[m];
    if (A8 == 1 && AG > 0 && live)
      a = ascale[m * (K / AGW) + k0 / AGW];
    if (QUANTIZE && AG > 0) {
      // The group's max |x| over its AG_LANES lanes (aligned runs of lanes: AG divides 512).
      float amax = 0.0f;
      BN_UNROLL
      for (int i = 0; i < 16; i++)
        amax = metal::max(amax, metal::abs(xv[i]));
      for (int step = 1; step < AG_LANES; step *= 2)
        amax = metal::max(amax, metal::simd_shuffle_xor(amax, ushort(step)));
      a = amax == 0.0f ? 1.0f : amax / 127.0f;
      inv = 1.0f / a;
    }
    BN_UNROLL
    for (int i = 0; i < 16; i++)
      xv[i] = (QUANTIZE ? bn_round_even(xv[i] * inv) : xv[i]) * pre[i];
    for (int r = 0; r < ROWS && live; r++) {
      float dot = 0.0f;
      BN_UNROLL
      for (int i = 0; i < 16; i++)
        dot = metal::fma(xv[i], w[r][i], dot);
      acc[m][r] += (A8 > 0 && AG > 0 ? a * s[r] : s[r]) * dot;
    }
  }
}

for (int m = 0; m < M; m++) {
  float v[ROWS];
  for (int r = 0; r < ROWS; r++) {
    v[r] = metal::simd_sum(acc[m][r]);
    if (TARGET)
      v[r] *= 0.0625f;  // s/16 stays in float32: never a subnormal fp16 scale
    if (A8 > 0 && AG == 0)
      v[r] *= token_scale[m];
  }
  if (GATE_UP) {
    // silu(gate) · up for the simdgroup's 2 outputs, lane j writing output j.
    for (int j = 0; j < 2; j++)
      if (lane == j && out0 + j < n_out)
        y[m * n_out + out0 + j] = T(v[j] / (1.0f + metal::exp(-v[j])) * v[j + 2]);
  } else {
    for (int r = 0; r < ROWS; r++)
      if (lane == r && out0 + r < n_out)
        y[m * n_out + out0 + r] = T(v[r]);
  }
}

// y[m, n] = Σ_k x[m, k] · W[n, k] for M = 1..8 tokens, straight from the nibble planes.
//   draft:  W = (hi - 8) · s          target: W = (16 (hi - 8) + (lo - 8)) · s / 16
// Template: T (scales and y dtype), M, TARGET, GS (weight group: 32, 64 or 128 columns per
// scale), A8 (x holds int8 codes and `ascale` their scales), AG (A8 scale per AG-column group,
// a multiple of 16; 0: one scale per token), GATE_UP (the planes are [gate; up] stacked, and
// y = silu(x·gateᵀ) · (x·upᵀ)).
// x arrives pre-scaled (kernels/dual_plane.py): column c of every 8 is multiplied by the inverse
// of the power of two at which its code sits in the word (draft: 16^-(c % 4); target:
// 256^-((c / 2) % 2)). A code is then decoded without a shift or a conversion: masked in place
// and ORed into the mantissa of 2^23, minus 2^23 and the plane offset, it is the float
// code · 16^j (or · 256^j), exact; x · it is x · code exactly. With A8 every partial dot over a
// lane's 16 columns is therefore the integer q · c (|Σ| < 2^24), bit for bit the integer result.
// Layout: one simdgroup owns ROWS = 4 output rows (GATE_UP: 2 gate rows and the same 2 up
// rows); lane l takes 16 consecutive columns of every 512-column block, i.e. 2 words of each
// plane. 16 divides every GS and AG, so those 16 columns share one weight scale and one A8
// scale. A block's weights are decoded once, then used by all M tokens.
constexpr int ROWS = 4;
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

// Rows past the end (ragged last simdgroup) read the last row and are never written.
int wrow[ROWS];
for (int r = 0; r < ROWS; r++) {
  const int o = metal::min(out0 + (GATE_UP ? r % 2 : r), n_out - 1);
  wrow[r] = GATE_UP && r >= 2 ? n_out + o : o;
}

for (int k0 = lane * 16; k0 < K; k0 += 512) {
  const int w0 = k0 / 8;
  const int g = k0 / GS;
  float w[ROWS][16];
  float s[ROWS];
  for (int r = 0; r < ROWS; r++) {
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
    BN_UNROLL
    for (int i = 0; i < 16; i++)
      xv[i] = x[m * K + k0 + i];
    const float a = AG > 0 ? ascale[m * (K / AGW) + k0 / AGW] : 1.0f;
    for (int r = 0; r < ROWS; r++) {
      float dot = 0.0f;
      BN_UNROLL
      for (int i = 0; i < 16; i++)
        dot = metal::fma(xv[i], w[r][i], dot);
      acc[m][r] += (AG > 0 ? a * s[r] : s[r]) * dot;
    }
  }
}

for (int m = 0; m < M; m++) {
  float v[ROWS];
  for (int r = 0; r < ROWS; r++) {
    v[r] = metal::simd_sum(acc[m][r]);
    if (TARGET)
      v[r] *= 0.0625f;  // s/16 stays in float32: never a subnormal fp16 scale
    if (A8 && AG == 0)
      v[r] *= ascale[m];
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

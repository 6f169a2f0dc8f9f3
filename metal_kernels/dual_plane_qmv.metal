// y[m, n] = Σ_k x[m, k] · W[n, k] for M = 1..8 tokens, straight from the nibble planes.
//   draft:  W = (hi - 8) · s          target: W = (16 (hi - 8) + (lo - 8)) · s / 16
// Template: T (x, scales, y dtype), M, TARGET, GS (weight group: 32, 64 or 128 columns per
// scale), A8 (quantize x with `ascale` on the fly), AG (A8 scale per AG-column group, AG a
// multiple of 16; 0: one scale per token).
// Layout: one simdgroup owns ROWS = 4 output rows; lane l takes 16 consecutive columns of every
// 512-column block, i.e. 2 words of each plane. 16 divides every GS and AG, so those 16 columns
// share one weight scale and one A8 scale. The weight words and scales are loaded once per block
// and reused for all M tokens.
// With A8 the inner product is integer: q (int8 codes) · c (4- or 8-bit weight codes) is exact in
// int32, and the scales (s, and the A8 scale a) multiply the partial sum once per 16 columns;
// a per-token a folds out of the whole dot product and is applied after the reduction.
constexpr int ROWS = 4;
constexpr int AGW = AG > 0 ? AG : 16;  // a divisor that is never used when AG = 0
const int lane = int(thread_index_in_simdgroup);
const int row0 = int(thread_position_in_grid.y) * ROWS;
const int words = K / 8;
const int groups = K / GS;

float acc[M][ROWS];
for (int m = 0; m < M; m++)
  for (int r = 0; r < ROWS; r++)
    acc[m][r] = 0.0f;

// Rows past N (ragged last simdgroup) read row N-1 and are never written.
int wrow[ROWS];
for (int r = 0; r < ROWS; r++)
  wrow[r] = metal::min(row0 + r, N - 1);

for (int k0 = lane * 16; k0 < K; k0 += 512) {
  const int w0 = k0 / 8;
  const int g = k0 / GS;
  uint h[ROWS][2];
  uint l[ROWS][2];
  float s[ROWS];
  for (int r = 0; r < ROWS; r++) {
    h[r][0] = hi[wrow[r] * words + w0];
    h[r][1] = hi[wrow[r] * words + w0 + 1];
    if (TARGET) {
      l[r][0] = lo[wrow[r] * words + w0];
      l[r][1] = lo[wrow[r] * words + w0 + 1];
    }
    s[r] = float(scales[wrow[r] * groups + g]);
  }
  for (int m = 0; m < M; m++) {
    if (A8) {
      const float a = ascale[AG > 0 ? m * (K / AGW) + k0 / AGW : m];
      int q[16];
      for (int i = 0; i < 16; i++)
        q[i] = bn_a8_code(float(x[m * K + k0 + i]), a);
      for (int r = 0; r < ROWS; r++) {
        int dot = 0;
        for (int i = 0; i < 16; i++) {
          int c = bn_nibble(h[r][i / 8], i % 8) - 8;
          if (TARGET)
            c = 16 * c + bn_nibble(l[r][i / 8], i % 8) - 8;
          dot += q[i] * c;
        }
        acc[m][r] += (AG > 0 ? a * s[r] : s[r]) * float(dot);
      }
    } else {
      float xv[16];
      for (int i = 0; i < 16; i++)
        xv[i] = float(x[m * K + k0 + i]);
      for (int r = 0; r < ROWS; r++) {
        float dot = 0.0f;
        for (int i = 0; i < 16; i++) {
          int c = bn_nibble(h[r][i / 8], i % 8) - 8;
          if (TARGET)
            c = 16 * c + bn_nibble(l[r][i / 8], i % 8) - 8;
          dot += xv[i] * float(c);
        }
        acc[m][r] += s[r] * dot;
      }
    }
  }
}

for (int m = 0; m < M; m++) {
  for (int r = 0; r < ROWS; r++) {
    float v = metal::simd_sum(acc[m][r]);
    if (TARGET)
      v *= 0.0625f;  // s/16 stays in float32: never a subnormal fp16 scale
    if (A8 && AG == 0)
      v *= ascale[m];
    if (lane == r && row0 + r < N)
      y[m * N + row0 + r] = T(v);
  }
}

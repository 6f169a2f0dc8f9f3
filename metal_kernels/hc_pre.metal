// DeepSeek-V4's hyper-connection before a sublayer, and the sublayer's RMSNorm, one
// threadgroup per token:
//   a_i  = mix_i · rsqrt(mean(streams²) + mix_eps) · scale[part(i)] + base_i
//   pre  = sigmoid(a[0, HC)) + hc_eps,   post = 2 · sigmoid(a[HC, 2 HC))
//   comb = Sinkhorn(a[2 HC, (2 + HC) HC) as HC x HC)
//   x    = Σ_k pre_k · stream_k (rounded to T, as the sublayer's input is)
//   out  = x · rsqrt(mean(x²) + norm_eps) · weight
// `mix` is the float32 streams times fnᵀ before the RMS scale: the scale is one scalar a
// token, so it is applied here to the (2 + HC) HC sums rather than to the HC · D inputs.
// Sinkhorn: row softmax + hc_eps, one column normalisation, then iters - 1 (row, column)
// pairs, each dividing by (sum + hc_eps). The matrix is tiny (16 entries at HC = 4), so one
// thread runs all of it in registers while the rest wait at one barrier; the threadgroup
// shares the RMS sum before it and the weighted sum x after it.
constexpr int MIX = (2 + HC) * HC;
const int tok = int(threadgroup_position_in_grid.y);
const int t = int(thread_index_in_threadgroup);
const int nt = int(threads_per_threadgroup.x);
const int len = HC * d;
const int row0 = tok * len;

threadgroup float part[32];
threadgroup float xsum[32];
threadgroup float pre[HC];
float ss = 0.0f;
for (int i = t; i < len; i += nt) {
  const float v = float(streams[row0 + i]);
  ss += v * v;
}
ss = metal::simd_sum(ss);
if (thread_index_in_simdgroup == 0)
  part[simdgroup_index_in_threadgroup] = ss;
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

if (t == 0) {
  float total = 0.0f;
  for (int s = 0; s < (nt + 31) / 32; s++)
    total += part[s];
  const float r = metal::rsqrt(total / float(len) + mix_eps);
  float a[MIX];
  for (int i = 0; i < MIX; i++)
    a[i] = mix[tok * MIX + i] * r * scale[i < HC ? 0 : (i < 2 * HC ? 1 : 2)] + base[i];
  for (int k = 0; k < HC; k++) {
    pre[k] = 1.0f / (1.0f + metal::exp(-a[k])) + hc_eps;
    post[tok * HC + k] = 2.0f / (1.0f + metal::exp(-a[HC + k]));
  }
  float c[HC][HC];
  for (int i = 0; i < HC; i++) {
    float top = -INFINITY;
    for (int j = 0; j < HC; j++)
      top = metal::max(top, a[2 * HC + i * HC + j]);
    float s = 0.0f;
    for (int j = 0; j < HC; j++) {
      c[i][j] = metal::exp(a[2 * HC + i * HC + j] - top);
      s += c[i][j];
    }
    for (int j = 0; j < HC; j++)
      c[i][j] = c[i][j] / s + hc_eps;
  }
  for (int it = 0; it < iters; it++) {
    if (it > 0) {
      for (int i = 0; i < HC; i++) {
        float s = 0.0f;
        for (int j = 0; j < HC; j++)
          s += c[i][j];
        for (int j = 0; j < HC; j++)
          c[i][j] = c[i][j] / (s + hc_eps);
      }
    }
    for (int j = 0; j < HC; j++) {
      float s = 0.0f;
      for (int i = 0; i < HC; i++)
        s += c[i][j];
      for (int i = 0; i < HC; i++)
        c[i][j] = c[i][j] / (s + hc_eps);
    }
  }
  for (int i = 0; i < HC; i++)
    for (int j = 0; j < HC; j++)
      comb[tok * HC * HC + i * HC + j] = c[i][j];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

// x is needed twice (its RMS, then the output): each thread recomputes its channels from the
// streams (cached reads) rather than keeping d / nt values in registers.
float xx = 0.0f;
for (int i = t; i < d; i += nt) {
  float acc = 0.0f;
  for (int k = 0; k < HC; k++)
    acc += pre[k] * float(streams[row0 + k * d + i]);
  const float v = float(T(acc));
  xx += v * v;
}
xx = metal::simd_sum(xx);
if (thread_index_in_simdgroup == 0)
  xsum[simdgroup_index_in_threadgroup] = xx;
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
float xtotal = 0.0f;
for (int s = 0; s < (nt + 31) / 32; s++)
  xtotal += xsum[s];
const float rx = metal::rsqrt(xtotal / float(d) + norm_eps);
for (int i = t; i < d; i += nt) {
  float acc = 0.0f;
  for (int k = 0; k < HC; k++)
    acc += pre[k] * float(streams[row0 + k * d + i]);
  x[tok * d + i] = T(float(T(acc)) * rx * float(weight[i]));
}

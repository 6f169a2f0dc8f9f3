// Pass 1 of the nested-KV attention read (KV4: hi; KV8: hi + lo/16), flash-decoding style.
// One threadgroup per (key split, batch · kv head · chunk of QN query rows). The QN rows are the
// GQA heads sharing the kv head times the L new tokens, so each key and value nibble is read once
// for all of them; the splits put enough threadgroups on the GPU at long context (one kv head
// alone would leave most cores idle). A split's keys go to the NSG simdgroups in blocks of 32.
//   QK: lane l owns key t0 + l and computes its whole dot product against q (staged once in
//       threadgroup memory, read as broadcasts), so no simd_sum per key. Scores need one
//       simd_max per row and block for the online softmax.
//   PV: lane l owns E = D/32 dims; the 32 probabilities of the block are shared through
//       threadgroup memory and each value row is read coalesced.
// The NSG simdgroup states are merged through threadgroup memory (one barrier), and the split's
// (max, sum, unnormalized output) is written for the merge pass (nested_kv_merge.metal).
// Causal: query i of L sits at position n_kv - L + i and sees keys 0 ..= that position.
constexpr int E = D / 32;
constexpr int W = D / 8;   // words per key row
constexpr int GW = G / 8;  // words per scale group
constexpr int NG = D / G;  // scale groups per key row
// The target's code is 16 u_hi + u_lo - 136 in units of s/16: one conversion per element and
// the 1/16 folded into the per-key scale (exact: a power of two).
constexpr float CSTEP = TARGET ? 0.0625f : 1.0f;
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int split = int(threadgroup_position_in_grid.x);
const int rep = n_q_heads / n_kv_heads;
const int rows = rep * L;  // query rows per kv head
const int chunks = (rows + QN - 1) / QN;
const int tg = int(threadgroup_position_in_grid.z);
const int bk = tg / chunks;  // b * n_kv_heads + kv head
const int j0 = (tg % chunks) * QN;
const int b = bk / n_kv_heads;
const int kvh = bk % n_kv_heads;

int qrow[QN];
int last[QN];
int last_any = -1;
for (int j = 0; j < QN; j++) {
  const int jj = metal::min(j0 + j, rows - 1);  // padding rows duplicate a real one, never written
  const int head = kvh * rep + jj / L;
  const int i = jj % L;
  qrow[j] = (b * n_q_heads + head) * L + i;
  last[j] = n_kv - L + i;
  last_any = metal::max(last_any, last[j]);
}

threadgroup float tq[QN][D];
for (int x = sg * 32 + lane; x < QN * D; x += NSG * 32)
  tq[x / D][x % D] = float(q[qrow[x / D] * D + x % D]) * scale;
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

const int t_begin = split * split_len;
const int t_end = metal::min(t_begin + split_len, last_any + 1);
const int kv_base = bk * t_cap;
const int d0 = lane * E;  // PV: this lane's dims share one word and one scale group
const int word = d0 / 8;
const int shift = (d0 % 8) * 4;
const int g = d0 / G;

float mrun[QN];
float den[QN];  // this lane's share of the softmax sum; one simd_sum at the end
float acc[QN][E];
for (int j = 0; j < QN; j++) {
  mrun[j] = -INFINITY;
  den[j] = 0.0f;
  for (int e = 0; e < E; e++)
    acc[j][e] = 0.0f;
}

threadgroup float tp[NSG][QN][32];
for (int t0 = t_begin + sg * 32; t0 < t_end; t0 += NSG * 32) {
  const int t = t0 + lane;
  const int key = kv_base + metal::min(t, t_end - 1);  // lanes past the end read a real key
  float s[QN];
  for (int j = 0; j < QN; j++)
    s[j] = 0.0f;
  for (int gi = 0; gi < NG; gi++) {
    float part[QN];
    for (int j = 0; j < QN; j++)
      part[j] = 0.0f;
    for (int w = gi * GW; w < (gi + 1) * GW; w++) {
      const uint kh = k_hi[key * W + w];
      const uint kl = TARGET ? k_lo[key * W + w] : 0u;
      for (int i = 0; i < 8; i++) {
        const float c = TARGET ? float(int(16u * ((kh >> (4 * i)) & 0xfu) + ((kl >> (4 * i)) & 0xfu)) - 136)
                               : float(bn_nibble(kh, i) - 8);
        for (int j = 0; j < QN; j++)
          part[j] += tq[j][w * 8 + i] * c;
      }
    }
    const float ks = k_scales[key * NG + gi] * CSTEP;
    for (int j = 0; j < QN; j++)
      s[j] += part[j] * ks;
  }
  for (int j = 0; j < QN; j++) {
    const float sj = (t < t_end && t <= last[j]) ? s[j] : -INFINITY;
    const float bmax = metal::simd_max(sj);
    float p = 0.0f;
    if (bmax > -INFINITY) {  // uniform across the simdgroup; else the row sees no key here
      const float mnew = metal::max(mrun[j], bmax);
      const float corr = metal::exp(mrun[j] - mnew);
      p = metal::exp(sj - mnew);
      den[j] = den[j] * corr + p;
      for (int e = 0; e < E; e++)
        acc[j][e] *= corr;
      mrun[j] = mnew;
    }
    tp[sg][j][lane] = p;
  }
  metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup);
  const int nk = metal::min(32, t_end - t0);
  for (int k = 0; k < nk; k++) {
    const int vrow = kv_base + t0 + k;
    const uint vh = v_hi[vrow * W + word] >> shift;
    const uint vl = TARGET ? v_lo[vrow * W + word] >> shift : 0u;
    const float vs = v_scales[vrow * NG + g] * CSTEP;
    float vd[E];
    for (int e = 0; e < E; e++)
      vd[e] = TARGET ? float(int(16u * ((vh >> (4 * e)) & 0xfu) + ((vl >> (4 * e)) & 0xfu)) - 136)
                     : float(bn_nibble(vh, e) - 8);
    for (int j = 0; j < QN; j++) {
      const float pv = tp[sg][j][k] * vs;
      for (int e = 0; e < E; e++)
        acc[j][e] += pv * vd[e];
    }
  }
  metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup);  // tp is rewritten next block
}

threadgroup float tg_m[NSG][QN];
threadgroup float tg_den[NSG][QN];
threadgroup float tg_acc[NSG][QN][D];
for (int j = 0; j < QN; j++) {
  const float total = metal::simd_sum(den[j]);
  if (lane == 0) {
    tg_m[sg][j] = mrun[j];
    tg_den[sg][j] = total;
  }
  for (int e = 0; e < E; e++)
    tg_acc[sg][j][d0 + e] = acc[j][e];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

// Simdgroup j % NSG finishes query row j; lanes keep their E dims. A row that saw no key in
// this split writes max -inf and sum 0, which the merge weighs 0.
for (int j = sg; j < QN; j += NSG) {
  if (j0 + j >= rows)
    break;
  float mmax = -INFINITY;
  for (int s = 0; s < NSG; s++)
    mmax = metal::max(mmax, tg_m[s][j]);
  float total = 0.0f;
  float out[E];
  for (int e = 0; e < E; e++)
    out[e] = 0.0f;
  for (int s = 0; s < NSG; s++) {
    const float w = tg_den[s][j] > 0.0f ? metal::exp(tg_m[s][j] - mmax) : 0.0f;
    total += tg_den[s][j] * w;
    for (int e = 0; e < E; e++)
      out[e] += tg_acc[s][j][d0 + e] * w;
  }
  const int at = qrow[j] * n_splits + split;
  for (int e = 0; e < E; e++)
    o_part[at * D + d0 + e] = out[e];
  if (lane == 0) {
    m_part[at] = mmax;
    l_part[at] = total;
  }
}

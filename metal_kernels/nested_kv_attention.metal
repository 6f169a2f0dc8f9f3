// Decode attention read straight from the nested KV planes (KV4: hi; KV8: hi + lo/16).
// One threadgroup per (batch, kv head, chunk of QN query rows): the QN rows are the GQA heads
// sharing that kv head times the L new tokens, so every key and value nibble is read once for all
// of them. NSG simdgroups split the keys (t ≡ simdgroup mod NSG); inside a simdgroup lane l holds
// E = D/32 consecutive dims. Per key: partial dots, one simd_sum per query row, online softmax in
// float32; at the end the NSG partial softmaxes are merged through threadgroup memory.
// Causal: query i of L sits at position n_kv - L + i and sees keys 0 ..= that position.
constexpr int E = D / 32;
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int rep = n_q_heads / n_kv_heads;
const int rows = rep * L;  // query rows per kv head
const int chunks = (rows + QN - 1) / QN;
const int tg = int(threadgroup_position_in_grid.z);
const int bk = tg / chunks;  // b * n_kv_heads + kv head
const int j0 = (tg % chunks) * QN;
const int b = bk / n_kv_heads;
const int kvh = bk % n_kv_heads;
const int d0 = lane * E;  // this lane's dims; they share one word and one scale group
const int word = d0 / 8;
const int shift = (d0 % 8) * 4;
const int g = d0 / G;

float qv[QN][E];
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
  for (int e = 0; e < E; e++)
    qv[j][e] = float(q[qrow[j] * D + d0 + e]) * scale;
}

float mrun[QN];
float den[QN];
float acc[QN][E];
for (int j = 0; j < QN; j++) {
  mrun[j] = -INFINITY;
  den[j] = 0.0f;
  for (int e = 0; e < E; e++)
    acc[j][e] = 0.0f;
}

const int kv_base = bk * t_cap;
for (int t = sg; t <= last_any; t += NSG) {
  const int kv_row = kv_base + t;
  float kd[E];
  float vd[E];
  {
    const uint kh = k_hi[kv_row * (D / 8) + word] >> shift;
    const uint vh = v_hi[kv_row * (D / 8) + word] >> shift;
    const float ksc = k_scales[kv_row * (D / G) + g];
    const float vsc = v_scales[kv_row * (D / G) + g];
    uint kl = 0;
    uint vl = 0;
    if (TARGET) {
      kl = k_lo[kv_row * (D / 8) + word] >> shift;
      vl = v_lo[kv_row * (D / 8) + word] >> shift;
    }
    for (int e = 0; e < E; e++) {
      float kc = float(bn_nibble(kh, e) - 8);
      float vc = float(bn_nibble(vh, e) - 8);
      if (TARGET) {
        kc += float(bn_nibble(kl, e) - 8) * 0.0625f;
        vc += float(bn_nibble(vl, e) - 8) * 0.0625f;
      }
      kd[e] = kc * ksc;
      vd[e] = vc * vsc;
    }
  }
  for (int j = 0; j < QN; j++) {
    float part = 0.0f;
    for (int e = 0; e < E; e++)
      part += qv[j][e] * kd[e];
    const float score = metal::simd_sum(part);
    if (t <= last[j]) {
      const float mnew = metal::max(mrun[j], score);
      const float corr = metal::exp(mrun[j] - mnew);
      const float p = metal::exp(score - mnew);
      den[j] = den[j] * corr + p;
      for (int e = 0; e < E; e++)
        acc[j][e] = acc[j][e] * corr + p * vd[e];
      mrun[j] = mnew;
    }
  }
}

threadgroup float tg_m[NSG][QN];
threadgroup float tg_den[NSG][QN];
threadgroup float tg_acc[NSG][QN][D];
for (int j = 0; j < QN; j++) {
  if (lane == 0) {
    tg_m[sg][j] = mrun[j];
    tg_den[sg][j] = den[j];
  }
  for (int e = 0; e < E; e++)
    tg_acc[sg][j][d0 + e] = acc[j][e];
}
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

// Simdgroup j % NSG finishes query row j; lanes keep their E dims.
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
  for (int e = 0; e < E; e++)
    o[qrow[j] * D + d0 + e] = T(out[e] / total);
}

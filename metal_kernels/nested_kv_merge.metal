// Pass 2 of the nested-KV attention read: merge the key splits of one query row exactly as a
// log-sum-exp, o = Σ_s w_s · acc_s / Σ_s w_s · l_s with w_s = exp(m_s − max_s m_s).
// One simdgroup per query row (a few rows per threadgroup); lane l owns E = D/32 dims. A split where the row saw no key
// (l_s = 0, m_s = −inf) weighs 0; every row sees key 0, so the total is positive.
constexpr int E = D / 32;
const int lane = int(thread_index_in_simdgroup);
const int row = int(thread_position_in_grid.y);
const int d0 = lane * E;
float mmax = -INFINITY;
for (int s = 0; s < n_splits; s++)
  mmax = metal::max(mmax, m_part[row * n_splits + s]);
float total = 0.0f;
float out[E];
for (int e = 0; e < E; e++)
  out[e] = 0.0f;
for (int s = 0; s < n_splits; s++) {
  const int at = row * n_splits + s;
  const float w = l_part[at] > 0.0f ? metal::exp(m_part[at] - mmax) : 0.0f;
  total += l_part[at] * w;
  for (int e = 0; e < E; e++)
    out[e] += o_part[at * D + d0 + e] * w;
}
const float inv = 1.0f / total;  // one exact division per lane, not E
for (int e = 0; e < E; e++)
  o[row * D + d0 + e] = T(out[e] * inv);

// DeepSeek-V4's MoE routing, one simdgroup per token: scores s_e = sqrt(softplus(logit_e)),
// the token's K experts and their weights s_e / Σ_chosen s · route_scale.
//   HASH: the experts are tid2eid[token id] (the first num_hash_layers layers);
//   else: the K largest s_e + bias_e (the bias only chooses; the weights use s_e).
// Lane l holds experts l, l + 32, ...; each of the K picks is a simdgroup arg-max (ties to the
// lower expert id) over the experts not yet picked, so nothing waits at a barrier.
constexpr int PER_LANE = (E + 31) / 32;
const int lane = int(thread_index_in_simdgroup);
const int tok = int(threadgroup_position_in_grid.y);

float score[PER_LANE];
float key[PER_LANE];
for (int i = 0; i < PER_LANE; i++) {
  const int e = i * 32 + lane;
  float s = 0.0f;
  if (e < E) {
    // softplus(v) = max(v, 0) + log1p(exp(-|v|)), log1p(u) = log(w) · u / (w - 1), w = 1 + u
    // (exact where 1 + u rounds, as Metal has no log1p)
    const float v = logits[tok * E + e];
    const float u = metal::exp(-metal::abs(v));
    const float w = 1.0f + u;
    const float l1p = w == 1.0f ? u : metal::log(w) * u / (w - 1.0f);
    s = metal::sqrt(metal::max(v, 0.0f) + l1p);
  }
  score[i] = s;
  key[i] = e < E ? (HASH ? 0.0f : s + bias[e]) : -INFINITY;
}

float wsum = 0.0f;
int pick[K];
float picked[K];
for (int k = 0; k < K; k++) {
  int e;
  if (HASH) {
    e = table[int(ids[tok]) * K + k];
  } else {
    float best = -INFINITY;
    int arg = E;
    for (int i = 0; i < PER_LANE; i++) {
      if (key[i] > best) {
        best = key[i];
        arg = i * 32 + lane;
      }
    }
    for (ushort m = 16; m > 0; m /= 2) {
      const float ob = metal::simd_shuffle_xor(best, m);
      const int oa = metal::simd_shuffle_xor(arg, m);
      if (ob > best || (ob == best && oa < arg)) {
        best = ob;
        arg = oa;
      }
    }
    e = arg;
    if (e % 32 == lane)
      key[e / 32] = -INFINITY;
  }
  // Every lane reads its own slot e / 32 (the same for all) and takes lane e % 32's.
  picked[k] = metal::simd_shuffle(score[metal::min(e / 32, PER_LANE - 1)], ushort(e % 32));
  pick[k] = e;
  wsum += picked[k];
}
if (lane == 0) {
  for (int k = 0; k < K; k++) {
    idx[tok * K + k] = uint(pick[k]);
    weight[tok * K + k] = picked[k] / wsum * route_scale;
  }
}

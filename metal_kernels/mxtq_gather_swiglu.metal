// Routed experts' gate and up projections with the SwiGLU in the epilogue, in one dispatch:
//   h[slot, r] = w[slot] · silu(min(g, limit)) · clip(u, −limit, limit)   (no clamp if limit ≤ 0)
//   g = ng[e, r] · Σ_i x[slot / k, i] · c[code_g(e, r, i)],   u likewise from the up stack,
// e = idx[slot], x rotated once for both (gate and up share in_features, seed and bits). The
// clamp is DeepSeek-V4's: gate from above only, up on both sides.
// Layout as mxtq_gather_qmv: one simdgroup per ROWS rows of one slot, lane l walks words
// l, l + 32, ... of the rows; each x value is loaded once and used by the ROWS gate rows and the
// ROWS up rows, and lane r finishes row r (norms, clamp, SiLU, product, route weight).
constexpr int VPW = 32 / BITS;
constexpr uint MASK = (1u << BITS) - 1u;
threadgroup float cb[1 << BITS];
if (thread_index_in_threadgroup < uint(1 << BITS))
  cb[thread_index_in_threadgroup] = codebook[thread_index_in_threadgroup];
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);

const int lane = int(thread_index_in_simdgroup);
const int slot = int(threadgroup_position_in_grid.z);
const int row0 = int(thread_position_in_grid.y) * ROWS;
const int words = in_features / VPW;
const uint e = idx[slot];
const int xrow = slot / k;

int wrow[ROWS];
for (int r = 0; r < ROWS; r++)
  wrow[r] = (int(e) * out_features + metal::min(row0 + r, out_features - 1)) * words;

float ag[ROWS];
float au[ROWS];
for (int r = 0; r < ROWS; r++) {
  ag[r] = 0.0f;
  au[r] = 0.0f;
}
for (int w = lane; w < words; w += 32) {
  float xv[VPW];
  for (int i = 0; i < VPW; i++)
    xv[i] = x[xrow * in_features + w * VPW + i];
  for (int r = 0; r < ROWS; r++) {
    const uint cg = packed_g[wrow[r] + w];
    const uint cu = packed_u[wrow[r] + w];
    float dg = 0.0f;
    float du = 0.0f;
    for (int i = 0; i < VPW; i++) {
      dg += xv[i] * cb[(cg >> (i * BITS)) & MASK];
      du += xv[i] * cb[(cu >> (i * BITS)) & MASK];
    }
    ag[r] += dg;
    au[r] += du;
  }
}
for (int r = 0; r < ROWS; r++) {
  float g = metal::simd_sum(ag[r]);
  float u = metal::simd_sum(au[r]);
  if (lane == r && row0 + r < out_features) {
    const int at = int(e) * out_features + row0 + r;
    g *= float(norms_g[at]);
    u *= float(norms_u[at]);
    if (limit > 0.0f) {
      g = metal::min(g, limit);
      u = metal::clamp(u, -limit, limit);
    }
    const float silu = g * (1.0f / (1.0f + metal::exp(-g)));
    h[slot * out_features + row0 + r] = silu * u * route_w[slot];
  }
}

// Routed-expert MXTQ matvec: y[slot, r] = norm[e, r] · Σ_i x[slot / xdiv, i] · c[code(e, r, i)],
// e = idx[slot], x already rotated (float32). xdiv = K when the K slots of a token share one x
// (gate/up), 1 when every slot has its own (down).
// Layout: threadgroup (32, 2): one simdgroup per ROWS (template; 16) output rows of one slot.
// Lane l walks words l, l + 32, ... of the rows, so a simdgroup reads 32 consecutive words
// (128 bytes) of each row per step; the lane's VPW x values are loaded once per word and reused
// by the ROWS rows. The 2^BITS-entry codebook is staged once per threadgroup in threadgroup
// memory. Norms are applied once per row after the simd_sum.
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
const int xrow = slot / xdiv;

int wrow[ROWS];
for (int r = 0; r < ROWS; r++)
  wrow[r] = (int(e) * out_features + metal::min(row0 + r, out_features - 1)) * words;

float acc[ROWS];
for (int r = 0; r < ROWS; r++)
  acc[r] = 0.0f;
for (int w = lane; w < words; w += 32) {
  float xv[VPW];
  for (int i = 0; i < VPW; i++)
    xv[i] = x[xrow * in_features + w * VPW + i];
  for (int r = 0; r < ROWS; r++) {
    const uint code = packed[wrow[r] + w];
    float dot = 0.0f;
    for (int i = 0; i < VPW; i++)
      dot += xv[i] * cb[(code >> (i * BITS)) & MASK];
    acc[r] += dot;
  }
}
for (int r = 0; r < ROWS; r++) {
  const float v = metal::simd_sum(acc[r]);
  if (lane == r && row0 + r < out_features)
    y[slot * out_features + row0 + r] = v * float(norms[int(e) * out_features + row0 + r]);
}

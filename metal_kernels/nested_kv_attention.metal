// Pass 1 of the nested-KV attention read (KV4: hi; KV8: hi + lo/16), flash-decoding style.
// One threadgroup per (key split, chunk of QN query rows, batch · kv head). The rows are the GQA
// heads sharing the kv head times the L new tokens; QN is as many of them as threadgroup memory
// holds (kernels/nested_kv.py `kv_geometry`), so at GQA 3, L <= 4 and head_dim 128 every key
// and value element is read and decoded once for all rows. The splits put enough threadgroups
// on the GPU at long context (one kv head alone would leave most cores idle). A split's keys go
// to the NSG simdgroups in blocks of 32.
//   QK: lane l owns key t0 + l and computes its whole dot product against q (staged once in
//       threadgroup memory, read as broadcasts), so no simd_sum per key. Scores need one
//       simd_max per row and block for the online softmax.
//   PV: lane l owns E = D/32 dims; the 32 probabilities of the block are shared through
//       threadgroup memory and each value row is read coalesced.
// Decode, as the weights' kernel (dual_plane_qmv.metal): a code is masked in place and ORed into
// the mantissa of 2^23 (bn_decode_w4 / bn_decode_w8), so it costs a mask, an or and a subtract,
// with no shift or int->float conversion; it comes out times the power of two `step` at which it
// sits in its word. q is staged pre-multiplied by 1/step (exact), so q·code is exact as before;
// values are used as code·step·scale and the output is multiplied by 1/step once at the end.
// The KV8 code is 16 u_hi + u_lo - 136 in units of s/16: the 1/16 rides in the same power of two.
// The NSG simdgroup states are merged through threadgroup memory (which then holds their outputs
// where q was), and the split's (max, sum, unnormalized output) is written for the merge pass
// (nested_kv_merge.metal).
// Causal: query i of L sits at position n_kv - L + i and sees keys 0 ..= that position.
constexpr int E = D / 32;
constexpr int W = D / 8;   // words per key row
constexpr int GW = G / 8;  // words per scale group
constexpr int NG = D / G;  // scale groups per key row
const int lane = int(thread_index_in_simdgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int split = int(threadgroup_position_in_grid.x);
const int j0 = int(threadgroup_position_in_grid.y) * QN;
const int bk = int(threadgroup_position_in_grid.z);  // b * n_kv_heads + kv head

// Row jj of the kv head is query jj % L of its GQA head jj / L, q row bk * rows + jj (a kv
// head's GQA heads are consecutive). Rows past `rows` (a ragged last chunk) stage the last real
// row's q and are never written; their causal limit only widens t_end by < L keys, which the
// real rows mask.
int last[QN];
int last_any = -1;
int qi = j0 % L;  // the one division: the row's query index is counted up from here
for (int j = 0; j < QN; j++) {
  last[j] = n_kv - L + qi;
  last_any = metal::max(last_any, last[j]);
  qi = qi + 1 == L ? 0 : qi + 1;
}

// 1/step of column c (or output dim c) as an exact power of two: 16^-(c % 4) for KV4 codes,
// 256^-((c / 2) % 2) / 16 for KV8 (bn_decode_w4 / bn_decode_w8), built from its exponent.
#define KV_UNSTEP(c) \
  as_type<float>(uint(127 - (TARGET ? 4 + 8 * (((c) / 2) % 2) : 4 * ((c) % 4))) << 23)
// Threadgroup memory (nested_kv.py `kv_threadgroup_bytes` checks the total): q in tmem[0] during
// the key loop, then the simdgroups' outputs in tmem[0 .. NSG - 1] for their merge; the block's
// probabilities in tp. Column w·8 + i of row j is [w][i][j]: the key loop's words are its only
// run-time index, so the 8·QN reads per word are fixed offsets from one address.
threadgroup float tmem[NSG][W][8][QN];
threadgroup float tp[NSG][QN][32];
// Thread x stages column x % D of rows x / D, x / D + NSG·32 / D, ... (every column of rows
// 0 .. QN - 1 when D > NSG·32), so its 1/step is computed once per column.
for (int d = (sg * 32 + lane) % D; d < D; d += NSG * 32) {
  const float qs = scale * KV_UNSTEP(d % 8);
  for (int j = (sg * 32 + lane) / D; j < QN; j += NSG * 32 >= D ? NSG * 32 / D : 1) {
    const int row = bk * rows + metal::min(j0 + j, rows - 1);
    tmem[0][d / 8][d % 8][j] = float(q[row * D + d]) * qs;
  }
}
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

// The 8 codes of word h (KV4) or of the pair h, l (KV8: nibbles paired into bytes 16 hi + lo,
// even and odd columns apart), each times its step.
#define KV_DECODE(h, l, out)                                                      \
  if (TARGET)                                                                     \
    bn_decode_w8(((h & 0x0F0F0F0Fu) << 4) | (l & 0x0F0F0F0Fu),                    \
                 (h & 0xF0F0F0F0u) | ((l >> 4) & 0x0F0F0F0Fu), out);              \
  else                                                                            \
    bn_decode_w4(h, out)

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
      float c[8];  // decoded once, used by all QN rows
      KV_DECODE(kh, kl, c);
      for (int i = 0; i < 8; i++)
        for (int j = 0; j < QN; j++)
          part[j] += tmem[0][w][i][j] * c[i];
    }
    const float ks = k_scales[key * NG + gi];
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
    const float vs = v_scales[vrow * NG + g];
    float c[8];  // only the first E are used
    KV_DECODE(vh, vl, c);
    float vd[E];  // code · step · scale, shared by the QN rows
    for (int e = 0; e < E; e++)
      vd[e] = c[e] * vs;
    for (int j = 0; j < QN; j++) {
      const float pj = tp[sg][j][k];
      for (int e = 0; e < E; e++)
        acc[j][e] += pj * vd[e];
    }
  }
  metal::simdgroup_barrier(metal::mem_flags::mem_threadgroup);  // tp is rewritten next block
}

threadgroup float tg_m[NSG][QN];
threadgroup float tg_den[NSG][QN];
// Every simdgroup is past its last read of q: tmem takes the outputs.
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
for (int j = 0; j < QN; j++) {
  const float total = metal::simd_sum(den[j]);
  if (lane == 0) {
    tg_m[sg][j] = mrun[j];
    tg_den[sg][j] = total;
  }
  for (int e = 0; e < E; e++)
    tmem[sg][word][d0 % 8 + e][j] = acc[j][e];
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
      out[e] += tmem[s][word][d0 % 8 + e][j] * w;
  }
  const int at = (bk * rows + j0 + j) * n_splits + split;
  for (int e = 0; e < E; e++)
    o_part[at * D + d0 + e] = out[e] * KV_UNSTEP(e);  // dim e's step in its shifted word
  if (lane == 0) {
    m_part[at] = mmax;
    l_part[at] = total;
  }
}
#undef KV_UNSTEP
#undef KV_DECODE

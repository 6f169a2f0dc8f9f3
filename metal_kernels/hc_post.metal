// DeepSeek-V4's hyper-connection after a sublayer: stream k takes the sublayer's output y at
// weight post_k plus the Sinkhorn mix of the old streams,
//   out[k, i] = post_k · y_i + Σ_j comb[j, k] · stream_j[i],
// rounded once to the streams' dtype. One thread per (token, channel) writes all HC streams'
// channel, so y and each old stream value are read once.
const int i = int(thread_position_in_grid.x);
const int tok = int(thread_position_in_grid.y);
if (i < d) {
  float s[HC];
  for (int j = 0; j < HC; j++)
    s[j] = float(streams[(tok * HC + j) * d + i]);
  const float yv = float(y[tok * d + i]);
  for (int k = 0; k < HC; k++) {
    float acc = post[tok * HC + k] * yv;
    for (int j = 0; j < HC; j++)
      acc = metal::fma(comb[(tok * HC + j) * HC + k], s[j], acc);
    out[(tok * HC + k) * d + i] = T(acc);
  }
}

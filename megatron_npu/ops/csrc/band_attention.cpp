// Band attention forward for fp32 CPU tensors (megatron_npu.ops.cpu_band_kernel builds and
// loads this file; megatron_npu.ops.attention calls it for windowed attention on CPU).
//
// Query row i attends keys j in [i + lo, i + hi] (clipped to [0, Skv)). ATen's CPU flash kernel
// only knows full and top-left causal attention and computes whole 256 x 512 tiles, so a band
// assembled from its pieces computes about 512 masked scores per query row. Here every query
// chunk works on the keys its rows can see: keys seen by all rows of the chunk in full tiles,
// the band's two edges in sub-blocks of EDGE_ROWS rows that each take only their own key
// columns, so about EDGE_ROWS masked scores per row are computed. Same algorithm as flash
// attention (online softmax over key tiles), same BLAS (sgemm_) and exp (exp_u20) as ATen's.
//
// Returns the output (BN, Sq, D) and the natural-log log-sum-exp of the scaled scores (BN, Sq);
// a row that sees no key outputs zeros and log-sum-exp -inf.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*,
                       const float*, const float*, const int*, const float*, const int*,
                       const float*, float*, const int*);

// Column-major BLAS gemm: C = alpha op(A) op(B) + beta C.
void gemm(char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
          int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const int m_ = m, n_ = n, k_ = k, lda_ = lda, ldb_ = ldb, ldc_ = ldc;
  sgemm_(&ta, &tb, &m_, &n_, &k_, &alpha, a, &lda_, b, &ldb_, &beta, c, &ldc_);
}

constexpr int64_t CHUNK_ROWS = 256;  // query rows per work item
constexpr int64_t KEY_TILE = 512;    // key columns per tile of the fully visible part
constexpr int64_t EDGE_ROWS = 64;    // query rows per sub-block on the band's edges
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Chunk {
  const float* q;  // (rows, D) of this chunk
  const float* k;  // (Skv, D) of this batch-head
  const float* v;
  int64_t first_row, rows, skv, d, lo, hi;
  float scale;
  float* scores;   // CHUNK_ROWS * KEY_TILE
  float* acc;      // rows * D, unnormalised output
  float* row_max;
  float* row_sum;

  int64_t first_key(int64_t r) const { return std::max<int64_t>(0, first_row + r + lo); }
  int64_t end_key(int64_t r) const { return std::min<int64_t>(skv, first_row + r + hi + 1); }

  // Rows [r0, r1) against keys [c0, c1): scores, online softmax, accumulate P V.
  void tile(int64_t r0, int64_t r1, int64_t c0, int64_t c1, bool masked) {
    const int64_t nr = r1 - r0, nc = c1 - c0;
    gemm('T', 'N', nc, nr, d, scale, k + c0 * d, d, q + r0 * d, d, 0.f, scores, nc);
    for (int64_t r = r0; r < r1; ++r) {
      float* row = scores + (r - r0) * nc;
      int64_t v0 = 0, v1 = nc;
      if (masked) {
        v0 = std::clamp<int64_t>(first_key(r) - c0, 0, nc);
        v1 = std::clamp<int64_t>(end_key(r) - c0, v0, nc);
        std::fill(row, row + v0, 0.f);
        std::fill(row + v1, row + nc, 0.f);
        if (v1 == v0) continue;  // this row sees none of these keys
      }
      const float tile_max = at::vec::reduce_all<float>(
          [](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row + v0, v1 - v0);
      const float old_max = row_max[r];
      const float new_max = std::max(old_max, tile_max);
      const Vec vmax(new_max);
      Vec vsum(0.f);
      int64_t c = v0;
      for (; c + Vec::size() <= v1; c += Vec::size()) {
        const Vec e = (Vec::loadu(row + c) - vmax).exp_u20();
        e.store(row + c);
        vsum = vsum + e;
      }
      float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
      for (; c < v1; ++c) {
        row[c] = std::exp(row[c] - new_max);
        sum += row[c];
      }
      if (old_max == NEG_INF) {
        row_sum[r] = sum;
      } else {
        const float correction = std::exp(old_max - new_max);
        row_sum[r] = row_sum[r] * correction + sum;
        if (correction != 1.f) {
          float* a = acc + r * d;
          at::vec::map([correction](Vec x) { return x * Vec(correction); }, a, a, d);
        }
      }
      row_max[r] = new_max;
    }
    gemm('N', 'N', d, nr, nc, 1.f, v + c0 * d, d, scores, nc, 1.f, acc + r0 * d, d);
  }

  // Keys [c0, c1) that only some rows see: sub-blocks of rows, each on its own key columns.
  void edge(int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < rows; r0 += EDGE_ROWS) {
      const int64_t r1 = std::min(rows, r0 + EDGE_ROWS);
      const int64_t x0 = std::max(c0, first_key(r0)), x1 = std::min(c1, end_key(r1 - 1));
      if (x1 > x0) tile(r0, r1, x0, x1, true);
    }
  }

  void run() {
    std::fill(acc, acc + rows * d, 0.f);
    std::fill(row_max, row_max + rows, NEG_INF);
    std::fill(row_sum, row_sum + rows, 0.f);
    const int64_t start = first_key(0), end = end_key(rows - 1);  // keys any row sees
    if (end > start) {
      // keys every row sees: [first key of the last row, end key of the first row)
      const int64_t all0 = std::clamp(first_key(rows - 1), start, end);
      const int64_t all1 = std::clamp(end_key(0), all0, end);
      if (all0 > start) edge(start, all0);
      for (int64_t c = all0; c < all1; c += KEY_TILE) {
        tile(0, rows, c, std::min(all1, c + KEY_TILE), false);
      }
      if (end > all1) edge(all1, end);
    }
  }
};

std::tuple<at::Tensor, at::Tensor> band_attention_forward(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, int64_t lo,
    int64_t hi, double scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.dim() == 3,
              "band_attention_forward: query, key, value must be (BN, S, D)");
  TORCH_CHECK(query.scalar_type() == at::kFloat && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat,
              "band_attention_forward: float32 tensors only");
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "band_attention_forward: CPU tensors only");
  TORCH_CHECK(key.sizes() == value.sizes() && query.size(0) == key.size(0) &&
                  query.size(2) == key.size(2),
              "band_attention_forward: query (BN, Sq, D), key and value (BN, Skv, D)");
  TORCH_CHECK(lo <= hi, "band_attention_forward: need lo <= hi");
  const auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const int64_t bn = q.size(0), sq = q.size(1), skv = k.size(1), d = q.size(2);
  auto out = at::empty({bn, sq, d}, q.options());
  auto lse = at::empty({bn, sq}, q.options());
  if (bn == 0 || sq == 0) return {out, lse};
  const int64_t chunks = (sq + CHUNK_ROWS - 1) / CHUNK_ROWS;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* lp = lse.data_ptr<float>();
  at::parallel_for(0, bn * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(CHUNK_ROWS * KEY_TILE), acc(CHUNK_ROWS * d);
    std::vector<float> row_max(CHUNK_ROWS), row_sum(CHUNK_ROWS);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / chunks, first_row = (item % chunks) * CHUNK_ROWS;
      const int64_t rows = std::min(CHUNK_ROWS, sq - first_row);
      Chunk chunk{qp + (b * sq + first_row) * d, kp + b * skv * d, vp + b * skv * d,
                  first_row, rows, skv, d, lo, hi, static_cast<float>(scale),
                  scores.data(), acc.data(), row_max.data(), row_sum.data()};
      chunk.run();
      for (int64_t r = 0; r < rows; ++r) {
        float* o = op + (b * sq + first_row + r) * d;
        float* l = lp + b * sq + first_row + r;
        if (row_max[r] == NEG_INF) {  // no visible key
          std::fill(o, o + d, 0.f);
          *l = NEG_INF;
          continue;
        }
        const float inv = 1.f / row_sum[r];
        const float* a = acc.data() + r * d;
        at::vec::map([inv](Vec x) { return x * Vec(inv); }, o, a, d);
        *l = row_max[r] + std::log(row_sum[r]);
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(megatron_npu_cpu, m) {
  m.def("band_attention_forward(Tensor query, Tensor key, Tensor value, int lo, int hi, "
        "float scale) -> (Tensor, Tensor)");
  m.impl("band_attention_forward", c10::DispatchKey::CPU, &band_attention_forward);
}

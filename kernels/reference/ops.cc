// Plain loops, double accumulation: the specification of every kernel.
#include "kernels/reference/ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tandem::kernels::ref {

void Gemm(const float* x, const float* w, const float* bias, float* y, int m, int n, int k) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double acc = bias != nullptr ? bias[j] : 0.0;
      for (int p = 0; p < k; ++p) {
        acc += static_cast<double>(x[static_cast<size_t>(i) * k + p]) *
               static_cast<double>(w[static_cast<size_t>(j) * k + p]);
      }
      y[static_cast<size_t>(i) * n + j] = static_cast<float>(acc);
    }
  }
}

void RmsNorm(const float* x, const float* weight, float eps, float* out, int m, int d) {
  for (int i = 0; i < m; ++i) {
    const float* xr = x + static_cast<size_t>(i) * d;
    double ss = 0.0;
    for (int j = 0; j < d; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    const double inv = 1.0 / std::sqrt(ss / d + static_cast<double>(eps));
    for (int j = 0; j < d; ++j) {
      out[static_cast<size_t>(i) * d + j] = static_cast<float>(xr[j] * inv * weight[j]);
    }
  }
}

void AddRmsNorm(float* residual, const float* x, const float* weight, float eps, float* out,
                int m, int d) {
  const size_t total = static_cast<size_t>(m) * d;
  for (size_t i = 0; i < total; ++i) residual[i] += x[i];
  RmsNorm(residual, weight, eps, out, m, d);
}

void RopeInvFreq(float* inv_freq, int head_dim, double theta, const RopeLlama3Scaling* llama3,
                 float linear_factor) {
  const int half = head_dim / 2;
  const double base = static_cast<float>(theta);
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[i] = static_cast<float>(1.0 / std::pow(base, static_cast<double>(e)));
  }
  if (linear_factor != 1.0f) {
    for (int i = 0; i < half; ++i) inv_freq[i] /= linear_factor;
  }
  if (llama3 != nullptr) {
    const double old_ctx = llama3->original_max_position_embeddings;
    const double low_wavelen = old_ctx / llama3->low_freq_factor;
    const double high_wavelen = old_ctx / llama3->high_freq_factor;
    for (int i = 0; i < half; ++i) {
      const double f = inv_freq[i];
      const double wavelen = 2.0 * M_PI / f;
      double scaled = wavelen > low_wavelen ? f / llama3->factor : f;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const double smooth = (old_ctx / wavelen - llama3->low_freq_factor) /
                              (llama3->high_freq_factor - llama3->low_freq_factor);
        scaled = (1.0 - smooth) * scaled / llama3->factor + smooth * scaled;
      }
      inv_freq[i] = static_cast<float>(scaled);
    }
  }
}

namespace {
void RopeRows(float* v, int rows, int head_dim, const float* cos_t, const float* sin_t) {
  const int half = head_dim / 2;
  for (int r = 0; r < rows; ++r) {
    float* h = v + static_cast<size_t>(r) * head_dim;
    for (int i = 0; i < half; ++i) {
      const double a = h[i], b = h[i + half];
      h[i] = static_cast<float>(a * cos_t[i] - b * sin_t[i]);
      h[i + half] = static_cast<float>(b * cos_t[i] + a * sin_t[i]);
    }
  }
}
}  // namespace

void Rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int t, int heads,
          int kv_heads, int head_dim) {
  const int half = head_dim / 2;
  std::vector<float> cos_t(half), sin_t(half);
  for (int i = 0; i < t; ++i) {
    for (int f = 0; f < half; ++f) {
      const float angle = static_cast<float>(positions[i]) * inv_freq[f];
      cos_t[f] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_t[f] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
    RopeRows(q + static_cast<size_t>(i) * heads * head_dim, heads, head_dim, cos_t.data(),
             sin_t.data());
    RopeRows(k + static_cast<size_t>(i) * kv_heads * head_dim, kv_heads, head_dim, cos_t.data(),
             sin_t.data());
  }
}

void SiluMul(const float* gate, const float* up, float* out, int m, int n) {
  const size_t total = static_cast<size_t>(m) * n;
  for (size_t i = 0; i < total; ++i) {
    const double g = gate[i];
    out[i] = static_cast<float>(g / (1.0 + std::exp(-g)) * up[i]);
  }
}

void WriteKv(const KvCacheView& view, int layer, const float* k, const float* v,
             const int32_t* slots, int t) {
  for (int i = 0; i < t; ++i) {
    const int32_t block = slots[i] / view.block_size;
    const int offset = slots[i] % view.block_size;
    for (int h = 0; h < view.kv_heads; ++h) {
      const size_t src = (static_cast<size_t>(i) * view.kv_heads + h) * view.head_dim;
      float* kd = view.K(block, layer, h, offset);
      float* vd = view.V(block, layer, h, offset);
      for (int d = 0; d < view.head_dim; ++d) {
        kd[d] = k[src + d];
        vd[d] = v[src + d];
      }
    }
  }
}

void PagedAttention(const KvCacheView& view, int layer, const float* q, float* out,
                    const int32_t* block_table, int q_start, int t, int heads, float scale) {
  const int hd = view.head_dim;
  const int group = heads / view.kv_heads;
  std::vector<double> scores;
  std::vector<double> acc(hd);
  for (int r = 0; r < t; ++r) {
    const int pos = q_start + r;
    scores.assign(pos + 1, 0.0);
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group;
      const float* qh = q + (static_cast<size_t>(r) * heads + h) * hd;
      double mx = -std::numeric_limits<double>::infinity();
      for (int j = 0; j <= pos; ++j) {
        const float* kj = view.K(block_table[j / view.block_size], layer, kvh, j % view.block_size);
        double s = 0.0;
        for (int d = 0; d < hd; ++d) s += static_cast<double>(qh[d]) * kj[d];
        scores[j] = s * scale;
        mx = std::max(mx, scores[j]);
      }
      double sum = 0.0;
      for (int j = 0; j <= pos; ++j) {
        scores[j] = std::exp(scores[j] - mx);
        sum += scores[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int j = 0; j <= pos; ++j) {
        const float* vj = view.V(block_table[j / view.block_size], layer, kvh, j % view.block_size);
        for (int d = 0; d < hd; ++d) acc[d] += scores[j] * vj[d];
      }
      float* oh = out + (static_cast<size_t>(r) * heads + h) * hd;
      for (int d = 0; d < hd; ++d) oh[d] = static_cast<float>(acc[d] / sum);
    }
  }
}

void PagedAttentionBatch(const KvCacheView& view, int layer, const float* q, float* out,
                         const AttentionSeq* seqs, int num_seqs, int heads, float scale) {
  size_t row = 0;
  const size_t row_floats = static_cast<size_t>(heads) * view.head_dim;
  for (int s = 0; s < num_seqs; ++s) {
    PagedAttention(view, layer, q + row * row_floats, out + row * row_floats, seqs[s].block_table,
                   seqs[s].q_start, seqs[s].q_len, heads, scale);
    row += static_cast<size_t>(seqs[s].q_len);
  }
}

void Argmax(const float* logits, int32_t* out, int m, int vocab) {
  for (int i = 0; i < m; ++i) {
    const float* row = logits + static_cast<size_t>(i) * vocab;
    int best = -1;
    for (int j = 0; j < vocab; ++j) {
      if (std::isnan(row[j])) continue;
      if (best < 0 || row[j] > row[best]) best = j;
    }
    out[i] = best < 0 ? 0 : best;
  }
}

namespace {
// max and log(sum exp(x - max)) of one row, in double.
void RowStats(const float* row, int n, double* mx, double* log_sum) {
  double m = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < n; ++j) m = std::max(m, static_cast<double>(row[j]));
  double sum = 0.0;
  for (int j = 0; j < n; ++j) sum += std::exp(row[j] - m);
  *mx = m;
  *log_sum = std::log(sum);
}
}  // namespace

void Softmax(const float* x, float* out, int m, int n) {
  for (int i = 0; i < m; ++i) {
    const float* row = x + static_cast<size_t>(i) * n;
    double mx, log_sum;
    RowStats(row, n, &mx, &log_sum);
    float* o = out + static_cast<size_t>(i) * n;
    for (int j = 0; j < n; ++j) o[j] = static_cast<float>(std::exp(row[j] - mx - log_sum));
  }
}

void LogSoftmax(const float* x, float* out, int m, int n) {
  for (int i = 0; i < m; ++i) {
    const float* row = x + static_cast<size_t>(i) * n;
    double mx, log_sum;
    RowStats(row, n, &mx, &log_sum);
    float* o = out + static_cast<size_t>(i) * n;
    for (int j = 0; j < n; ++j) o[j] = static_cast<float>(row[j] - mx - log_sum);
  }
}

}  // namespace tandem::kernels::ref

// Per-row top-k of (pre + bias) over a block of rows, and AuxK's top-k over the dead latents, while
// the block is still in cache. torch.topk copies each row into a (value, index) buffer and
// partially sorts it. Here the row is split into G groups of ~16 (element j in group j % G, so the
// first pass is a vectorised element-wise max over G-wide strips); the k-th largest group maximum
// is a floor under the row's k-th largest value (k groups reach it), so only the groups whose
// maximum reaches the floor (k of them, for distinct values) are read again: their values at or
// above the floor are the candidates, and the top k of those are the answer.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int CHUNK = 16;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct MinHeap {
  float* v;
  int64_t* ix;
  int k;
  int size = 0;

  float floor() const { return size < k ? NEG_INF : v[0]; }

  void push(float value, int64_t index) {
    if (size < k) {
      int pos = size++;
      v[pos] = value;
      ix[pos] = index;
      while (pos > 0) {
        int parent = (pos - 1) / 2;
        if (v[parent] <= v[pos]) break;
        std::swap(v[parent], v[pos]);
        std::swap(ix[parent], ix[pos]);
        pos = parent;
      }
    } else if (value > v[0]) {
      v[0] = value;
      ix[0] = index;
      int pos = 0;
      while (true) {
        int l = 2 * pos + 1, r = l + 1, m = pos;
        if (l < k && v[l] < v[m]) m = l;
        if (r < k && v[r] < v[m]) m = r;
        if (m == pos) break;
        std::swap(v[pos], v[m]);
        std::swap(ix[pos], ix[m]);
        pos = m;
      }
    }
  }
};

}  // namespace

// pre [rows, n] (without bias), bias [n]; writes vals/idx [rows, k] and, when k_aux > 0,
// aux_vals/aux_idx [rows, k_aux] chosen among the latents where dead (uint8 [n]) is nonzero.
void topk_rows(const torch::Tensor& pre, const torch::Tensor& bias, int64_t k, torch::Tensor vals,
               torch::Tensor idx, const torch::Tensor& dead, int64_t k_aux, torch::Tensor aux_vals,
               torch::Tensor aux_idx) {
  TORCH_CHECK(pre.dtype() == torch::kFloat32 && pre.is_contiguous() && pre.dim() == 2, "pre: contiguous float32 [rows, n]");
  TORCH_CHECK(bias.dtype() == torch::kFloat32 && bias.is_contiguous(), "bias: contiguous float32");
  TORCH_CHECK(vals.is_contiguous() && idx.is_contiguous(), "outputs must be contiguous");
  const int64_t rows = pre.size(0), n = pre.size(1);
  TORCH_CHECK(k >= 1 && k <= n && k_aux >= 0 && k_aux <= n, "k out of range");
  const float* P = pre.data_ptr<float>();
  const float* B = bias.data_ptr<float>();
  float* V = vals.data_ptr<float>();
  int64_t* I = idx.data_ptr<int64_t>();
  const bool aux = k_aux > 0;
  const uint8_t* D = aux ? dead.data_ptr<uint8_t>() : nullptr;
  float* AV = aux ? aux_vals.data_ptr<float>() : nullptr;
  int64_t* AI = aux ? aux_idx.data_ptr<int64_t>() : nullptr;

  const int64_t groups = (n + CHUNK - 1) / CHUNK;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> maxima(groups), scratch(groups), cand_v;
    std::vector<int64_t> cand_i, order;
    float masked[CHUNK];
    for (int64_t r = begin; r < end; ++r) {
      const float* row = P + r * n;
      // Pass 1: each group's maximum of (pre + bias), a G-wide strip at a time.
      for (int64_t c = 0; c < groups; ++c) maxima[c] = row[c] + B[c];
      for (int64_t base = groups; base < n; base += groups) {
        const int64_t width = std::min(groups, n - base);
        const float* x = row + base;
        const float* b = B + base;
        float* m = maxima.data();
#pragma omp simd
        for (int64_t c = 0; c < width; ++c) {
          const float value = x[c] + b[c];
          m[c] = value > m[c] ? value : m[c];
        }
      }
      // The floor: the k-th largest group maximum (-inf when there are no more than k groups).
      float floor = NEG_INF;
      if (groups > k) {
        std::copy(maxima.begin(), maxima.end(), scratch.begin());
        std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end(), std::greater<float>());
        floor = scratch[k - 1];
      }
      // Pass 2: the candidates, from the groups that reach the floor.
      cand_v.clear();
      cand_i.clear();
      for (int64_t c = 0; c < groups; ++c) {
        if (!(maxima[c] >= floor)) continue;  // NaN is skipped too: the loss's finiteness check sees it
        for (int64_t j = c; j < n; j += groups) {
          const float value = row[j] + B[j];
          if (value >= floor) {
            cand_v.push_back(value);
            cand_i.push_back(j);
          }
        }
      }
      float* out_v = V + r * k;
      int64_t* out_i = I + r * k;
      const int64_t found = static_cast<int64_t>(cand_v.size());
      order.resize(found);
      for (int64_t q = 0; q < found; ++q) order[q] = q;
      if (found > k) {
        std::nth_element(order.begin(), order.begin() + (k - 1), order.end(),
                         [&](int64_t a, int64_t b) { return cand_v[a] > cand_v[b]; });
      }
      for (int64_t q = 0; q < k; ++q) {
        if (q < found) {
          out_v[q] = cand_v[order[q]];
          out_i[q] = cand_i[order[q]];
        } else {  // fewer candidates than k: only with NaN in the row
          out_v[q] = NEG_INF;
          out_i[q] = q;
        }
      }
      if (!aux) continue;
      // AuxK: k_aux is large (d_in / 2), so a plain scan of the dead latents into a heap.
      MinHeap dead_top{AV + r * k_aux, AI + r * k_aux, static_cast<int>(k_aux)};
      for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
        const int len = static_cast<int>(std::min<int64_t>(CHUNK, n - j0));
        float best_dead = NEG_INF;
        for (int t = 0; t < len; ++t) {
          masked[t] = D[j0 + t] ? row[j0 + t] + B[j0 + t] : NEG_INF;
          best_dead = std::max(best_dead, masked[t]);
        }
        if (dead_top.size < dead_top.k || best_dead > dead_top.v[0]) {
          for (int t = 0; t < len; ++t) {
            if (dead_top.size < dead_top.k || masked[t] > dead_top.v[0]) dead_top.push(masked[t], j0 + t);
          }
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("topk_rows", &topk_rows, "per-row top-k of pre + bias (and AuxK's over dead latents)");
}

// Fused mHC kernels for the eager CPU step (trnrt/models/kernels/__init__.py builds and loads this).
//
// Why: an eager decode step of the tiny model is dispatch-bound. The mHC coefficients alone are
// ~110 aten calls per sub-layer (a truncated Sinkhorn of 39 normalisations on [T, 4, 4] tensors),
// more than half of all ops in a step. These kernels do the same arithmetic, in the same order
// of operations as trnrt/models/glm5_next/model.py (hc_coefficients, HyperConnection.collapse,
// hc_expand), in one call each. Built with -ffp-contract=off so no multiply-add is fused behind
// our back: only reduction order may differ from aten (a few ulp; tests bound the difference).
// torch.export never sees these ops: the model calls them only outside export/compile.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace {

inline float sigmoidf(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// One row of hc_collapse: coefficients from mix [(2+N)N] and streams x [N, D].
template <typename scalar_t>
void collapse_row(const float* mix, const scalar_t* x, const float* base, const float* scale, int64_t n,
                  int64_t d, int64_t iters, float hc_eps, float* pre, float* post, float* comb,
                  scalar_t* collapsed) {
  for (int64_t i = 0; i < n; ++i) {
    pre[i] = sigmoidf(mix[i] * scale[0] + base[i]) + hc_eps;
    post[i] = 2.0f * sigmoidf(mix[n + i] * scale[1] + base[n + i]);
  }
  // comb = softmax(mix_comb * scale[2] + base_comb, dim=-1) + eps, row by row.
  for (int64_t i = 0; i < n; ++i) {
    float* row = comb + i * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = mix[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j];
      mx = std::max(mx, row[j]);
    }
    float s = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      s += row[j];
    }
    for (int64_t j = 0; j < n; ++j) row[j] = row[j] / s + hc_eps;
  }
  // Truncated Sinkhorn: 1 column normalisation, then (iters - 1) row + column pairs.
  auto cols = [&]() {
    for (int64_t j = 0; j < n; ++j) {
      float s = 0.0f;
      for (int64_t i = 0; i < n; ++i) s += comb[i * n + j];
      s += hc_eps;
      for (int64_t i = 0; i < n; ++i) comb[i * n + j] = comb[i * n + j] / s;
    }
  };
  cols();
  for (int64_t it = 1; it < iters; ++it) {
    for (int64_t i = 0; i < n; ++i) {
      float s = 0.0f;
      for (int64_t j = 0; j < n; ++j) s += comb[i * n + j];
      s += hc_eps;
      for (int64_t j = 0; j < n; ++j) comb[i * n + j] = comb[i * n + j] / s;
    }
    cols();
  }
  // collapsed[d] = sum_i pre[i] * x[i, d]: fp32 products and sum, cast to the stream dtype.
  for (int64_t k = 0; k < d; ++k) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += pre[i] * static_cast<float>(x[i * d + k]);
    collapsed[k] = static_cast<scalar_t>(s);
  }
}

// streams [..., N, D] (fp32 or bf16), fn [(2+N)N, N*D], base [(2+N)N], scale [3] ->
// post [..., N] fp32, comb [..., N, N] fp32, collapsed [..., D] in the stream dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> hc_collapse(const at::Tensor& streams, const at::Tensor& fn,
                                                           const at::Tensor& base, const at::Tensor& scale,
                                                           int64_t iters, double hc_eps, double norm_eps) {
  TORCH_CHECK(streams.dim() >= 2, "hc_collapse: streams must be [..., N, D]");
  TORCH_CHECK(iters >= 1, "hc_collapse: iters must be >= 1");
  const int64_t n = streams.size(-2), d = streams.size(-1);
  TORCH_CHECK(fn.dim() == 2 && fn.size(0) == (2 + n) * n && fn.size(1) == n * d, "hc_collapse: fn shape");
  TORCH_CHECK(base.numel() == (2 + n) * n && scale.numel() == 3, "hc_collapse: base/scale shape");
  auto lead = streams.sizes().slice(0, streams.dim() - 2).vec();
  auto x = streams.contiguous();
  const int64_t rows = x.numel() / (n * d);
  // Unweighted fp32 RMSNorm of the flattened streams, then the projection as aten's linear.
  auto flat = x.reshape({rows, n * d}).to(at::kFloat);
  auto normed = at::empty_like(flat);
  {
    const float* f = flat.data_ptr<float>();
    float* o = normed.data_ptr<float>();
    const float eps = static_cast<float>(norm_eps);
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* fr = f + r * n * d;
        double ss = 0.0;
        for (int64_t k = 0; k < n * d; ++k) ss += static_cast<double>(fr[k]) * fr[k];
        const float ms = static_cast<float>(ss / static_cast<double>(n * d));
        const float inv = 1.0f / std::sqrt(ms + eps);
        for (int64_t k = 0; k < n * d; ++k) o[r * n * d + k] = fr[k] * inv;
      }
    });
  }
  auto mix = at::linear(normed, fn.to(at::kFloat)).contiguous();  // [rows, (2+N)N]
  auto base_f = base.to(at::kFloat).contiguous();
  auto scale_f = scale.to(at::kFloat).contiguous();
  auto opts = x.options().dtype(at::kFloat);
  auto pre = at::empty({rows, n}, opts);
  auto post = at::empty({rows, n}, opts);
  auto comb = at::empty({rows, n, n}, opts);
  auto collapsed = at::empty({rows, d}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "hc_collapse", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const float* m = mix.data_ptr<float>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        collapse_row<scalar_t>(m + r * (2 + n) * n, xs + r * n * d, base_f.data_ptr<float>(),
                               scale_f.data_ptr<float>(), n, d, iters, static_cast<float>(hc_eps),
                               pre.data_ptr<float>() + r * n, post.data_ptr<float>() + r * n,
                               comb.data_ptr<float>() + r * n * n, collapsed.data_ptr<scalar_t>() + r * d);
      }
    });
  });
  auto with = [&](std::vector<int64_t> tail) {
    auto s = lead;
    s.insert(s.end(), tail.begin(), tail.end());
    return s;
  };
  return {post.view(with({n})), comb.view(with({n, n})), collapsed.view(with({d}))};
}

// new[j, d] = post[j] * out[d] + sum_i comb[i, j] * residual[i, d]  (fp32 only).
// post [..., N], comb [..., N, N], out [..., D], residual [..., N, D] -> [..., N, D].
at::Tensor hc_expand(const at::Tensor& post, const at::Tensor& comb, const at::Tensor& out,
                     const at::Tensor& residual) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat &&
                  post.scalar_type() == at::kFloat && comb.scalar_type() == at::kFloat,
              "hc_expand: fp32 only");
  const int64_t n = residual.size(-2), d = residual.size(-1);
  const int64_t rows = residual.numel() / (n * d);
  auto p = post.contiguous(), c = comb.contiguous(), o = out.contiguous(), res = residual.contiguous();
  auto result = at::empty_like(res);
  const float* pp = p.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* op = o.data_ptr<float>();
  const float* rp = res.data_ptr<float>();
  float* yp = result.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* cr = cp + r * n * n;
      const float* rr = rp + r * n * d;
      for (int64_t j = 0; j < n; ++j) {
        float* y = yp + (r * n + j) * d;
        const float pj = pp[r * n + j];
        for (int64_t k = 0; k < d; ++k) {
          float acc = 0.0f;
          for (int64_t i = 0; i < n; ++i) acc += cr[i * n + j] * rr[i * d + k];
          y[k] = pj * op[r * d + k] + acc;
        }
      }
    }
  });
  return result;
}

}  // namespace

TORCH_LIBRARY(trnrt, m) {
  m.def("hc_collapse(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("hc_expand(Tensor post, Tensor comb, Tensor out, Tensor residual) -> Tensor");
}

TORCH_LIBRARY_IMPL(trnrt, CPU, m) {
  m.impl("hc_collapse", &hc_collapse);
  m.impl("hc_expand", &hc_expand);
}

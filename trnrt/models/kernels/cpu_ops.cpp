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

#include <algorithm>
#include <cmath>
#include <optional>
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

// transformers' RMSNorm: fp32 normalisation, cast to the input dtype, then times weight (in that dtype).
// x [..., D] fp32/bf16, weight [D] same dtype -> [..., D].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: weight must be [D] in the input dtype");
  auto xc = x.contiguous();
  auto wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const scalar_t* wp = wc.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* xr = xp + r * d;
        double ss = 0.0;
        for (int64_t k = 0; k < d; ++k) {
          const float v = static_cast<float>(xr[k]);
          ss += static_cast<double>(v * v);
        }
        const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(d)) + static_cast<float>(eps));
        for (int64_t k = 0; k < d; ++k) {
          const scalar_t n = static_cast<scalar_t>(static_cast<float>(xr[k]) * inv);
          yp[r * d + k] = static_cast<scalar_t>(static_cast<float>(wp[k]) * static_cast<float>(n));
        }
      }
    });
  });
  return y;
}

// KDA o_norm: all-fp32 RMSNorm times weight, times sigmoid(gate), cast back to x's dtype (fp32 only).
// x [..., D], gate [..., D], weight [D] -> [..., D].
at::Tensor gated_rms_norm(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && gate.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "gated_rms_norm: fp32 only");
  auto xc = x.contiguous(), gc = gate.contiguous(), wc = weight.contiguous();
  auto y = at::empty_like(xc);
  const int64_t d = xc.size(-1), rows = xc.numel() / d;
  const float* xp = xc.data_ptr<float>();
  const float* gp = gc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* xr = xp + r * d;
      double ss = 0.0;
      for (int64_t k = 0; k < d; ++k) ss += static_cast<double>(xr[k] * xr[k]);
      const float inv = 1.0f / std::sqrt(static_cast<float>(ss / static_cast<double>(d)) + static_cast<float>(eps));
      for (int64_t k = 0; k < d; ++k) yp[r * d + k] = (wp[k] * (xr[k] * inv)) * sigmoidf(gp[r * d + k]);
    }
  });
  return y;
}

// One KDA decode token per row (fp32 model), the body of KDAttention.forward for S == 1 between
// the fused input projection and the output gate: causal depthwise conv over the slot's window
// (updated in place), l2-normed q/k, per-channel forget gate, the delta-rule recurrence over the
// slot's state (updated in place).
//   qkv [B, 3*H*Dk] (may be a strided view), f [B, H*Dk] = f_b_proj(f_a), bb [B, H] (b_proj),
//   conv_state [L, NS, C, K-1], kda_state [L, NS, H, Dk, Dk], slot_ids [B], restart [B] bool,
//   valid [B] bool, conv_w [C, K], dt_bias [H*Dk], a_log [H] -> o [B, H, Dk] fp32.
at::Tensor kda_decode(const at::Tensor& qkv_in, const at::Tensor& f_in, const at::Tensor& bb_in,
                      at::Tensor& conv_state, at::Tensor& kda_state, int64_t layer, const at::Tensor& slot_ids,
                      const at::Tensor& restart, const at::Tensor& valid, const at::Tensor& conv_w,
                      const at::Tensor& dt_bias, const at::Tensor& a_log, std::optional<double> lower_bound,
                      double q_scale) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&qkv_in, &f_in, &bb_in, &conv_state, &kda_state, &conv_w, &dt_bias, &a_log})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "kda_decode: fp32 only");
  TORCH_CHECK(conv_state.is_contiguous() && kda_state.is_contiguous(), "kda_decode: state must be contiguous");
  const int64_t B = qkv_in.size(0), H = a_log.size(0), Dk = dt_bias.size(0) / H, C = 3 * H * Dk;
  const int64_t K = conv_w.size(-1), NS = conv_state.size(1);
  TORCH_CHECK(qkv_in.size(-1) == C && conv_state.size(2) == C && conv_state.size(3) == K - 1, "kda_decode: conv shapes");
  TORCH_CHECK(kda_state.size(1) == NS && kda_state.size(2) == H && kda_state.size(3) == Dk && kda_state.size(4) == Dk,
              "kda_decode: state shape");
  auto qkv = qkv_in.reshape({B, C}).contiguous(), f = f_in.reshape({B, H * Dk}).contiguous();
  auto bb = bb_in.reshape({B, H}).contiguous(), w = conv_w.reshape({C, K}).contiguous();
  auto slots = slot_ids.to(at::kLong).contiguous();
  auto rst = restart.to(at::kBool).contiguous(), val = valid.reshape({B}).to(at::kBool).contiguous();
  auto dtb = dt_bias.contiguous(), al = a_log.contiguous();
  auto out = at::empty({B, H, Dk}, qkv.options());
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sl[b] >= 0 && sl[b] < NS, "kda_decode: slot id out of range");
  float* cs = conv_state.data_ptr<float>() + layer * NS * C * (K - 1);
  float* ks = kda_state.data_ptr<float>() + layer * NS * H * Dk * Dk;
  // Read every row's window and state before writing any (rows share only scratch slot 0).
  std::vector<float> win(B * C * (K - 1)), s(B * H * Dk * Dk);
  for (int64_t b = 0; b < B; ++b) {
    const bool r = rst.data_ptr<bool>()[b];
    for (int64_t i = 0; i < C * (K - 1); ++i) win[b * C * (K - 1) + i] = r ? 0.0f : cs[sl[b] * C * (K - 1) + i];
    for (int64_t i = 0; i < H * Dk * Dk; ++i) s[b * H * Dk * Dk + i] = r ? 0.0f : ks[sl[b] * H * Dk * Dk + i];
  }
  const float* qp = qkv.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  std::vector<float> y(C), g(Dk), q(Dk), k(Dk), kv(Dk);
  for (int64_t b = 0; b < B; ++b) {
    const bool ok = val.data_ptr<bool>()[b];
    float* wb = win.data() + b * C * (K - 1);
    for (int64_t c = 0; c < C; ++c) {
      const float x_new = qp[b * C + c];
      float acc = 0.0f;  // taps: window (oldest first), then the new token
      for (int64_t t = 0; t < K - 1; ++t) acc += wb[c * (K - 1) + t] * wp[c * K + t];
      acc += x_new * wp[c * K + K - 1];
      y[c] = acc * sigmoidf(acc);  // silu
      for (int64_t t = 0; t + 1 < K - 1; ++t) wb[c * (K - 1) + t] = wb[c * (K - 1) + t + 1];
      wb[c * (K - 1) + K - 2] = x_new;  // window after this token
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* yq = y.data() + h * Dk;
      const float* yk = y.data() + (H + h) * Dk;
      const float* yv = y.data() + (2 * H + h) * Dk;
      float sq = 0.0f, sk = 0.0f;
      for (int64_t i = 0; i < Dk; ++i) { sq += yq[i] * yq[i]; sk += yk[i] * yk[i]; }
      const float nq = std::sqrt(sq + 1e-6f), nk = std::sqrt(sk + 1e-6f);
      for (int64_t i = 0; i < Dk; ++i) {
        q[i] = yq[i] / nq * static_cast<float>(q_scale);
        k[i] = yk[i] / nk;
      }
      const float rate = std::exp(al.data_ptr<float>()[h]);
      for (int64_t i = 0; i < Dk; ++i) {
        const float fv = f.data_ptr<float>()[b * H * Dk + h * Dk + i] + dtb.data_ptr<float>()[h * Dk + i];
        float gv;
        if (lower_bound.has_value()) {
          gv = static_cast<float>(*lower_bound) * sigmoidf(rate * fv);
        } else {
          gv = -rate * (fv > 20.0f ? fv : std::log(1.0f + std::exp(fv)));
        }
        g[i] = ok ? gv : 0.0f;
      }
      const float beta = ok ? sigmoidf(bb.data_ptr<float>()[b * H + h]) : 0.0f;
      float* sh = s.data() + (b * H + h) * Dk * Dk;  // [Dk (key), Dv]
      for (int64_t i = 0; i < Dk; ++i) {
        const float dec = std::exp(g[i]);
        for (int64_t j = 0; j < Dk; ++j) sh[i * Dk + j] = sh[i * Dk + j] * dec;
      }
      for (int64_t j = 0; j < Dk; ++j) {
        float a = 0.0f;
        for (int64_t i = 0; i < Dk; ++i) a += sh[i * Dk + j] * k[i];
        kv[j] = a;
      }
      for (int64_t i = 0; i < Dk; ++i)
        for (int64_t j = 0; j < Dk; ++j) sh[i * Dk + j] = sh[i * Dk + j] + k[i] * (beta * (yv[j] - kv[j]));
      float* o = out.data_ptr<float>() + (b * H + h) * Dk;
      for (int64_t j = 0; j < Dk; ++j) {
        float a = 0.0f;
        for (int64_t i = 0; i < Dk; ++i) a += sh[i * Dk + j] * q[i];
        o[j] = a;
      }
    }
  }
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(win.data() + b * C * (K - 1), C * (K - 1), cs + sl[b] * C * (K - 1));
    std::copy_n(s.data() + b * H * Dk * Dk, H * Dk * Dk, ks + sl[b] * H * Dk * Dk);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(trnrt, m) {
  m.def("hc_collapse(Tensor streams, Tensor fn, Tensor base, Tensor scale, int iters, float hc_eps, "
        "float norm_eps) -> (Tensor, Tensor, Tensor)");
  m.def("hc_expand(Tensor post, Tensor comb, Tensor out, Tensor residual) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gated_rms_norm(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor");
  m.def("kda_decode(Tensor qkv, Tensor f, Tensor bb, Tensor(a!) conv_state, Tensor(b!) kda_state, int layer, "
        "Tensor slot_ids, Tensor restart, Tensor valid, Tensor conv_w, Tensor dt_bias, Tensor a_log, "
        "float? lower_bound, float q_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(trnrt, CPU, m) {
  m.impl("hc_collapse", &hc_collapse);
  m.impl("hc_expand", &hc_expand);
  m.impl("rms_norm", &rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("kda_decode", &kda_decode);
}

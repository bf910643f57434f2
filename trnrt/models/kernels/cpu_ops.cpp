// Fused mHC kernels for the eager CPU step (trnrt/models/kernels/__init__.py builds and loads this).
//
// Why: an eager decode step of the tiny model is dispatch-bound. The mHC coefficients alone are
// ~110 aten calls per sub-layer (a truncated Sinkhorn of 39 normalisations on [T, 4, 4] tensors),
// more than half of all ops in a step. These kernels do the same arithmetic, in the same order
// of operations as trnrt/models/glm5_next/hyper.py (hc_coefficients, HyperConnection.collapse,
// hc_expand), in one call each. Built with -ffp-contract=off so no multiply-add is fused behind
// our back: only reduction order may differ from aten (a few ulp; tests bound the difference).
// torch.export never sees these ops: the model calls them only outside export/compile.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
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
  // normalise(line, elem): each line of n entries (entry k at line * line + k * elem) / (sum + eps).
  auto normalise = [&](int64_t line, int64_t elem) {
    for (int64_t a = 0; a < n; ++a) {
      float* v = comb + a * line;
      float s = 0.0f;
      for (int64_t k = 0; k < n; ++k) s += v[k * elem];
      s += hc_eps;
      for (int64_t k = 0; k < n; ++k) v[k * elem] = v[k * elem] / s;
    }
  };
  normalise(1, n);  // columns
  for (int64_t it = 1; it < iters; ++it) {
    normalise(n, 1);  // rows
    normalise(1, n);  // columns
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

// Dot product of n floats; the simd reduction lets the compiler vectorise it (summation order
// differs from a sequential loop and from BLAS by rounding only).
inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Indices of the k largest of v[0..n) (ties: lower index first), largest first.
std::vector<int64_t> top_indices(const float* v, int64_t n, int64_t k) {
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i) idx[i] = i;
  k = std::min(k, n);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int64_t a, int64_t b) { return v[a] > v[b] || (v[a] == v[b] && a < b); });
  idx.resize(k);
  return idx;
}

// The routed half of a decode MoE (fp32): the Router (sigmoid scores, group-limited top-k with the
// score-correction bias for choosing only, normalised and scaled weights) and the chosen experts'
// clamped-SwiGLU MLPs, summed over the top-k in fp32.
//   x [T, D], router_w [E, D], bias [E], gate_up [E, 2I, D], down [E, D, I] -> [T, D].
at::Tensor moe_routed(const at::Tensor& x_in, const at::Tensor& router_w, const at::Tensor& bias,
                      const at::Tensor& gate_up, const at::Tensor& down, int64_t n_group, int64_t topk_group,
                      int64_t top_k, bool norm_topk_prob, double scaling, double limit_d) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x_in, &router_w, &bias, &gate_up, &down})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "moe_routed: fp32 only");
  auto x = x_in.contiguous(), rw = router_w.contiguous(), bi = bias.contiguous();
  auto gu = gate_up.contiguous(), dn = down.contiguous();
  const int64_t T = x.size(0), D = x.size(1), E = rw.size(0), I = dn.size(2);
  TORCH_CHECK(E % n_group == 0 && gu.size(0) == E && gu.size(1) == 2 * I && gu.size(2) == D, "moe_routed: shapes");
  const int64_t per = E / n_group;
  const float limit = static_cast<float>(limit_d);
  auto out = at::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    std::vector<float> scores(E), choice(E), grp(n_group), h(2 * I), a(I), acc(D);
    for (int64_t t = b; t < e; ++t) {
      const float* xt = xp + t * D;
      for (int64_t j = 0; j < E; ++j) {
        scores[j] = sigmoidf(dot(xt, rw.data_ptr<float>() + j * D, D));
        choice[j] = scores[j] + bi.data_ptr<float>()[j];
      }
      if (n_group > 1) {
        for (int64_t g = 0; g < n_group; ++g) {
          auto two = top_indices(choice.data() + g * per, per, 2);
          float sum = 0.0f;
          for (auto i : two) sum += choice[g * per + i];
          grp[g] = sum;
        }
        auto keep = top_indices(grp.data(), n_group, topk_group);
        std::vector<bool> kept(n_group, false);
        for (auto g : keep) kept[g] = true;
        for (int64_t j = 0; j < E; ++j)
          if (!kept[j / per]) choice[j] = -INFINITY;
      }
      auto idx = top_indices(choice.data(), E, top_k);
      std::vector<float> w(idx.size());
      float wsum = 0.0f;
      for (size_t i = 0; i < idx.size(); ++i) { w[i] = scores[idx[i]]; wsum += w[i]; }
      for (size_t i = 0; i < idx.size(); ++i) {
        if (norm_topk_prob) w[i] = w[i] / (wsum + 1e-20f);
        w[i] = w[i] * static_cast<float>(scaling);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (size_t i = 0; i < idx.size(); ++i) {
        const float* g = gu.data_ptr<float>() + idx[i] * 2 * I * D;
        for (int64_t r = 0; r < 2 * I; ++r) h[r] = dot(g + r * D, xt, D);
        for (int64_t r = 0; r < I; ++r) {
          const float gate = std::min(h[r], limit);
          const float up = std::min(std::max(h[I + r], -limit), limit);
          a[r] = gate * sigmoidf(gate) * up;
        }
        const float* dw = dn.data_ptr<float>() + idx[i] * D * I;
        for (int64_t r = 0; r < D; ++r) acc[r] += dot(dw + r * I, a.data(), I) * w[i];
      }
      std::copy(acc.begin(), acc.end(), out.data_ptr<float>() + t * D);
    }
  });
  return out;
}

// Decode attention of one MLA layer over a selection (fp32): scores of the absorbed query against
// the K selected latents, masked softmax, the weighted latent sum.
//   qa [B, H, R], latent_state [L, NB, bs, R], blk/off/visible [B, K] -> [B, H, R].
at::Tensor mla_decode_attn(const at::Tensor& qa_in, const at::Tensor& latent_state, int64_t layer,
                           const at::Tensor& blk_in, const at::Tensor& off_in, const at::Tensor& vis_in,
                           double scaling) {
  TORCH_CHECK(qa_in.scalar_type() == at::kFloat && latent_state.scalar_type() == at::kFloat,
              "mla_decode_attn: fp32 only");
  TORCH_CHECK(latent_state.is_contiguous(), "mla_decode_attn: latent state must be contiguous");
  auto qa = qa_in.contiguous();
  auto blk = blk_in.to(at::kLong).contiguous(), off = off_in.to(at::kLong).contiguous();
  auto vis = vis_in.to(at::kBool).contiguous();
  const int64_t B = qa.size(0), H = qa.size(1), R = qa.size(2), K = blk.size(1);
  const int64_t NB = latent_state.size(1), bs = latent_state.size(2);
  TORCH_CHECK(latent_state.size(3) == R, "mla_decode_attn: latent width");
  const float* lat = latent_state.data_ptr<float>() + layer * NB * bs * R;
  auto out = at::empty({B, H, R}, qa.options());
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<const float*> rows(K);
    std::vector<float> p(K);
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t j = 0; j < K; ++j) {
        const int64_t bl = blk.data_ptr<int64_t>()[b * K + j], of = off.data_ptr<int64_t>()[b * K + j];
        TORCH_CHECK(bl >= 0 && bl < NB && of >= 0 && of < bs, "mla_decode_attn: selection out of range");
        rows[j] = lat + (bl * bs + of) * R;
      }
      const bool* vb = vis.data_ptr<bool>() + b * K;
      for (int64_t h = 0; h < H; ++h) {
        const float* q = qa.data_ptr<float>() + (b * H + h) * R;
        float mx = -INFINITY;
        for (int64_t j = 0; j < K; ++j) {
          p[j] = vb[j] ? dot(q, rows[j], R) * static_cast<float>(scaling) : -INFINITY;
          mx = std::max(mx, p[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < K; ++j) { p[j] = std::exp(p[j] - mx); sum += p[j]; }
        float* o = out.data_ptr<float>() + (b * H + h) * R;
        std::fill(o, o + R, 0.0f);
        for (int64_t j = 0; j < K; ++j) {
          const float pj = p[j] / sum;
          const float* rj = rows[j];
#pragma omp simd
          for (int64_t r = 0; r < R; ++r) o[r] += pj * rj[r];
        }
      }
    }
  });
  return out;
}

// The DSA indexer of one decode token per row (fp32), from its projections to the selection:
// pool the open k-pool when this token completes it (written to the paged pooled keys), shift
// the slot's tail, score every complete visible pool, keep the top k_top pools, and return the
// attention selection (blocks, offsets, visibility of topk*kpool + kpool-1 tokens) and the pool mask.
//   k [B, Di] (k_norm(wk x)), gs [B, Di] (compress-gate scores), q [B, Hi, Di] (wq_b q_resid),
//   hw [B, Hi] (weights_proj x), tail_state [F, NS, kp-1, 2, Di], pooled_state [F, NB, bs/kp, Di],
//   ape [kp, Di], block_tables [B, MB], slot_ids/pos/pool_blk/pool_off [B], valid [B] bool.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> indexer_decode(
    const at::Tensor& k_in, const at::Tensor& gs_in, const at::Tensor& q_in, const at::Tensor& hw_in,
    at::Tensor& tail_state, at::Tensor& pooled_state, int64_t layer, const at::Tensor& ape_in,
    const at::Tensor& block_tables, const at::Tensor& slot_ids, const at::Tensor& pos_in, const at::Tensor& valid_in,
    const at::Tensor& pool_blk, const at::Tensor& pool_off, int64_t k_top, int64_t block_size) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&k_in, &gs_in, &q_in, &hw_in, &tail_state,
                                                                      &pooled_state, &ape_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "indexer_decode: fp32 only");
  TORCH_CHECK(tail_state.is_contiguous() && pooled_state.is_contiguous(), "indexer_decode: state must be contiguous");
  auto k = k_in.contiguous(), gs = gs_in.contiguous(), q = q_in.contiguous(), hw = hw_in.contiguous();
  auto ape = ape_in.contiguous();
  auto bt = block_tables.to(at::kLong).contiguous(), sl = slot_ids.to(at::kLong).contiguous();
  auto pos = pos_in.to(at::kLong).contiguous(), val = valid_in.to(at::kBool).contiguous();
  auto pb = pool_blk.to(at::kLong).contiguous(), po = pool_off.to(at::kLong).contiguous();
  const int64_t B = k.size(0), Di = k.size(1), Hi = q.size(1), kp = ape.size(0), MB = bt.size(1);
  const int64_t NS = tail_state.size(1), NB = pooled_state.size(1), ppb = pooled_state.size(2);
  TORCH_CHECK(tail_state.size(2) == kp - 1 && ppb * kp == block_size, "indexer_decode: state shapes");
  const int64_t T = MB * block_size, P = T / kp, kk = std::min(k_top, P), K = kk * kp + kp - 1;
  float* tail = tail_state.data_ptr<float>() + layer * NS * (kp - 1) * 2 * Di;
  float* pooled = pooled_state.data_ptr<float>() + layer * NB * ppb * Di;
  const int64_t* slp = sl.data_ptr<int64_t>();
  // ext rows per batch row: the kp-1 tail entries, then this token's (k, gs)
  std::vector<float> ext(B * kp * 2 * Di), pooled_new(B * Di);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slp[b] >= 0 && slp[b] < NS, "indexer_decode: slot id out of range");
    std::copy_n(tail + slp[b] * (kp - 1) * 2 * Di, (kp - 1) * 2 * Di, ext.data() + b * kp * 2 * Di);
    float* last = ext.data() + (b * kp + kp - 1) * 2 * Di;
    std::copy_n(k.data_ptr<float>() + b * Di, Di, last);
    std::copy_n(gs.data_ptr<float>() + b * Di, Di, last + Di);
    for (int64_t c = 0; c < Di; ++c) {  // softmax over the pool's kp tokens, per channel
      float mx = -INFINITY;
      for (int64_t m = 0; m < kp; ++m)
        mx = std::max(mx, ext[((b * kp + m) * 2 + 1) * Di + c] + ape.data_ptr<float>()[m * Di + c]);
      float sum = 0.0f;
      std::vector<float> e(kp);
      for (int64_t m = 0; m < kp; ++m) {
        e[m] = std::exp(ext[((b * kp + m) * 2 + 1) * Di + c] + ape.data_ptr<float>()[m * Di + c] - mx);
        sum += e[m];
      }
      float acc = 0.0f;
      for (int64_t m = 0; m < kp; ++m) acc += (e[m] / sum) * ext[((b * kp + m) * 2) * Di + c];
      pooled_new[b * Di + c] = acc;
    }
  }
  for (int64_t b = 0; b < B; ++b) {  // writes: the pooled key (incomplete pools -> scratch block 0), the tail
    const int64_t bl = pb.data_ptr<int64_t>()[b], of = po.data_ptr<int64_t>()[b];
    TORCH_CHECK(bl >= 0 && bl < NB && of >= 0 && of < ppb, "indexer_decode: pool target out of range");
    std::copy_n(pooled_new.data() + b * Di, Di, pooled + (bl * ppb + of) * Di);
    std::copy_n(ext.data() + (b * kp + 1) * 2 * Di, (kp - 1) * 2 * Di, tail + slp[b] * (kp - 1) * 2 * Di);
  }
  auto opts = at::TensorOptions().dtype(at::kLong);
  auto blk = at::empty({B, K}, opts), off = at::empty({B, K}, opts);
  auto vis = at::empty({B, K}, opts.dtype(at::kBool));
  auto pool_mask = at::zeros({B, 1, P}, opts.dtype(at::kBool));
  const float qscale = 1.0f / std::sqrt(static_cast<float>(Di)), hscale = 1.0f / std::sqrt(static_cast<float>(Hi));
  const float lowest = std::numeric_limits<float>::lowest();
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> score(P);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t pb_ = pos.data_ptr<int64_t>()[b];
      const int64_t* btr = bt.data_ptr<int64_t>() + b * MB;
      const float* qb = q.data_ptr<float>() + b * Hi * Di;
      const float* hb = hw.data_ptr<float>() + b * Hi;
      for (int64_t p = 0; p < P; ++p) {
        if (p * kp + kp - 1 > pb_) { score[p] = lowest; continue; }  // not a complete visible pool
        const int64_t bl = btr[p / ppb];
        TORCH_CHECK(bl >= 0 && bl < NB, "indexer_decode: block id out of range");
        const float* pk = pooled + (bl * ppb + p % ppb) * Di;
        float s = 0.0f;
        for (int64_t h = 0; h < Hi; ++h) s += (hb[h] * hscale) * std::max(dot(qb + h * Di, pk, Di) * qscale, 0.0f);
        score[p] = s;
      }
      auto sel = top_indices(score.data(), P, kk);
      const bool ok = val.data_ptr<bool>()[b];
      int64_t* bk = blk.data_ptr<int64_t>() + b * K;
      int64_t* of = off.data_ptr<int64_t>() + b * K;
      bool* vs = vis.data_ptr<bool>() + b * K;
      for (int64_t i = 0; i < kk; ++i) {
        const int64_t p = sel[i];
        const bool cand = p * kp + kp - 1 <= pb_;
        if (cand) pool_mask.data_ptr<bool>()[b * P + p] = true;
        for (int64_t m = 0; m < kp; ++m) {
          const int64_t tok = p * kp + m;
          bk[i * kp + m] = btr[tok / block_size];
          of[i * kp + m] = tok % block_size;
          vs[i * kp + m] = cand || !ok;
        }
      }
      const int64_t tail_start = (pb_ + 1) / kp * kp;
      for (int64_t m = 0; m < kp - 1; ++m) {
        const int64_t tok = std::min(tail_start + m, T - 1);
        bk[kk * kp + m] = btr[tok / block_size];
        of[kk * kp + m] = tok % block_size;
        vs[kk * kp + m] = (tail_start + m <= pb_) || !ok;
      }
    }
  });
  return {blk, off, vis, pool_mask};
}

// The pairwise part of one KDA prefill chunk (trnrt/models/glm5_next/kda.py kda_chunked): for
// q, k, G [N, C, Dk] (N = batch x heads; G the inclusive cumulative log-decay of the chunk),
//   A[t, s] = sum_c (k[t,c] * k[s,c]) * exp(G[t,c] - G[s,c])   for s < t, else 0
//   M[t, s] = sum_c (q[t,c] * k[s,c]) * exp(G[t,c] - G[s,c])   for s <= t, else 0
// -> (A, M) [N, C, C] fp32. The PyTorch path materialises the [N, C, C, Dk] decay tensor (exp over
// both triangles, masked) and reduces it: ~8 passes over C*C*Dk floats per layer, about half of a
// tiny-model prefill chunk. Here each exp is computed once, for the lower triangle only, and the
// products keep the PyTorch path's order ((x_t * k_s) * decay); only the sum order differs.
std::tuple<at::Tensor, at::Tensor> kda_chunk_pairs(const at::Tensor& q_in, const at::Tensor& k_in,
                                                   const at::Tensor& g_in) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.sizes() == k_in.sizes() && q_in.sizes() == g_in.sizes(),
              "kda_chunk_pairs: q, k, G must be [N, C, Dk] of one shape");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat && g_in.scalar_type() == at::kFloat,
              "kda_chunk_pairs: fp32 only");
  auto q = q_in.contiguous(), k = k_in.contiguous(), g = g_in.contiguous();
  const int64_t n = q.size(0), c = q.size(1), d = q.size(2);
  auto A = at::zeros({n, c, c}, q.options());
  auto M = at::zeros({n, c, c}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* ap = A.data_ptr<float>();
  float* mp = M.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> kd(d);
    for (int64_t i = b0; i < b1; ++i) {
      const float* qi = qp + i * c * d;
      const float* ki = kp + i * c * d;
      const float* gi = gp + i * c * d;
      for (int64_t t = 0; t < c; ++t) {
        const float* qt = qi + t * d;
        const float* kt = ki + t * d;
        const float* gt = gi + t * d;
        for (int64_t s = 0; s <= t; ++s) {
          const float* ks = ki + s * d;
          const float* gs = gi + s * d;
          for (int64_t j = 0; j < d; ++j) kd[j] = std::exp(gt[j] - gs[j]);
          float sm = 0.0f, sa = 0.0f;
          for (int64_t j = 0; j < d; ++j) sm += (qt[j] * ks[j]) * kd[j];
          if (s < t) {
            for (int64_t j = 0; j < d; ++j) sa += (kt[j] * ks[j]) * kd[j];
          }
          mp[(i * c + t) * c + s] = sm;
          ap[(i * c + t) * c + s] = sa;
        }
      }
    }
  });
  return {A, M};
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
  m.def("moe_routed(Tensor x, Tensor router_w, Tensor bias, Tensor gate_up, Tensor down, int n_group, "
        "int topk_group, int top_k, bool norm_topk_prob, float scaling, float limit) -> Tensor");
  m.def("mla_decode_attn(Tensor qa, Tensor latent_state, int layer, Tensor blk, Tensor off, Tensor visible, "
        "float scaling) -> Tensor");
  m.def("indexer_decode(Tensor k, Tensor gs, Tensor q, Tensor hw, Tensor(a!) tail_state, Tensor(b!) pooled_state, "
        "int layer, Tensor ape, Tensor block_tables, Tensor slot_ids, Tensor pos, Tensor valid, Tensor pool_blk, "
        "Tensor pool_off, int k_top, int block_size) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("kda_chunk_pairs(Tensor q, Tensor k, Tensor G) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(trnrt, CPU, m) {
  m.impl("hc_collapse", &hc_collapse);
  m.impl("hc_expand", &hc_expand);
  m.impl("rms_norm", &rms_norm);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("kda_decode", &kda_decode);
  m.impl("moe_routed", &moe_routed);
  m.impl("mla_decode_attn", &mla_decode_attn);
  m.impl("indexer_decode", &indexer_decode);
  m.impl("kda_chunk_pairs", &kda_chunk_pairs);
}

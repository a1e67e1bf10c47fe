// Native CPU LAMB op (`slipstream_cpu_lamb`): the two passes of a FusedLamb step over fp32 CPU tensors.
//
// Interface (slipstream/ops/fallback/cpu_lamb.py has the same functions):
//   lamb_moments(params, grads, exp_avgs, exp_avg_sqs, updates, segments, beta1, beta2, eps, weight_decay,
//                eps_inside_sqrt) -> float64 [segments, 2]
//   lamb_apply(params, updates, segments, scales) -> None
//   simd_level() -> "avx512" | "avx2" | "neon" | "scalar"
// `segments` is an int64 [S, 3] tensor of rows (tensor index, start, end): the parts of the tensors whose norms
// the trust ratio needs (under ZeRO a piece holds parts of several parameters).
//
// [Note: cpu_lamb passes] LAMB's trust ratio needs the whole update's norm before any weight moves, so a step is
// two passes. lamb_moments reads p, g, m, v and writes m, v and the update u = m / (sqrt(v) + eps) + wd * p
// (eps_inside_sqrt: m / sqrt(v + eps)), summing p^2 and u^2 per segment from registers in the same sweep;
// lamb_apply reads p, u and writes p -= scale[segment] * u. That is 40 bytes per fp32 parameter against
// Adam's 28. Work is cut into chunks of at most kChunk elements inside one segment; each chunk sums into its
// own slot and the slots are added in order, so the sums do not depend on the number of threads.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../includes/cpu_adam_simd.h"

namespace {

struct Coeffs {
  float beta2, one_minus_beta1, one_minus_beta2, eps, weight_decay;
  bool eps_inside_sqrt;
};

// One chunk of work: elements [start, end) of tensor `item`, which belong to segment `segment`.
struct Chunk {
  int64_t item, segment, start, end;
};

constexpr int64_t kChunk = 1 << 15;
// Squares are summed in fp32 registers over blocks of this many elements, then added into a double.
constexpr int64_t kBlock = 1024;
// Below this many elements in a whole call, one thread is faster than waking the OpenMP team.
constexpr int64_t kSerialThreshold = 1 << 16;

inline float update1(float p, float g, float& m, float& v, const Coeffs& c) {
  m = std::fma(c.one_minus_beta1, g - m, m);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = c.eps_inside_sqrt ? std::sqrt(v + c.eps) : std::sqrt(v) + c.eps;
  return std::fma(c.weight_decay, p, m / denom);
}

// Pass 1 over elements [0, n): moments and update; adds sum(p^2), sum(u^2) into sums[0], sums[1].
void moments_span(const float* p, const float* g, float* m, float* v, float* u, int64_t n, const Coeffs& c,
                  double* sums) {
  int64_t i = 0;
#if !defined(SLIPSTREAM_SIMD_SCALAR)
  using slipstream_simd::Vec;
  const Vec::T beta2 = Vec::set1(c.beta2), omb1 = Vec::set1(c.one_minus_beta1);
  const Vec::T omb2 = Vec::set1(c.one_minus_beta2), eps = Vec::set1(c.eps), wd = Vec::set1(c.weight_decay);
  alignas(64) float lanes[2][Vec::W];
  while (i + Vec::W <= n) {
    const int64_t block_end = std::min(n, i + kBlock);
    Vec::T acc_p = Vec::set1(0.0f), acc_u = Vec::set1(0.0f);
    for (; i + Vec::W <= block_end; i += Vec::W) {
      const Vec::T pv = Vec::load(p + i), gv = Vec::load(g + i);
      Vec::T mv = Vec::load(m + i);
      mv = Vec::fma(omb1, Vec::sub(gv, mv), mv);
      const Vec::T vv = Vec::fma(Vec::mul(omb2, gv), gv, Vec::mul(Vec::load(v + i), beta2));
      const Vec::T denom = c.eps_inside_sqrt ? Vec::sqrt(Vec::add(vv, eps)) : Vec::add(Vec::sqrt(vv), eps);
      const Vec::T uv = Vec::fma(wd, pv, Vec::div(mv, denom));
      Vec::store(m + i, mv);
      Vec::store(v + i, vv);
      Vec::store(u + i, uv);
      acc_p = Vec::fma(pv, pv, acc_p);
      acc_u = Vec::fma(uv, uv, acc_u);
    }
    Vec::store(lanes[0], acc_p);
    Vec::store(lanes[1], acc_u);
    for (int k = 0; k < Vec::W; ++k) {
      sums[0] += lanes[0][k];
      sums[1] += lanes[1][k];
    }
  }
#endif
  for (; i < n; ++i) {
    const float uv = update1(p[i], g[i], m[i], v[i], c);
    u[i] = uv;
    sums[0] += static_cast<double>(p[i]) * p[i];
    sums[1] += static_cast<double>(uv) * uv;
  }
}

// Pass 2 over elements [0, n): p -= scale * u.
void apply_span(float* p, const float* u, int64_t n, float scale) {
  int64_t i = 0;
#if !defined(SLIPSTREAM_SIMD_SCALAR)
  using slipstream_simd::Vec;
  const Vec::T neg = Vec::set1(-scale);
  for (; i + Vec::W <= n; i += Vec::W) {
    Vec::store(p + i, Vec::fma(neg, Vec::load(u + i), Vec::load(p + i)));
  }
#endif
  for (; i < n; ++i) p[i] = std::fma(-scale, u[i], p[i]);
}

void check_fp32(const at::Tensor& t, const char* what, const char* list, size_t idx) {
  TORCH_CHECK_VALUE(t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous(),
                    "cpu_lamb.", what, ": ", list, "[", idx, "] must be a dense contiguous CPU tensor; pass "
                    "t.contiguous().cpu() or use the PyTorch fallback (SLIPSTREAM_OPS=fallback)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "cpu_lamb.", what, ": ", list, "[", idx, "] has dtype ",
                   t.scalar_type(), "; the native op takes float32 only (the fallback takes the rest)");
}

// The segments as chunks of at most kChunk elements, checked against the tensors' sizes.
std::vector<Chunk> make_chunks(const at::Tensor& segments, const std::vector<at::Tensor>& params, const char* what) {
  TORCH_CHECK_VALUE(segments.dim() == 2 && segments.size(1) == 3 && segments.scalar_type() == at::kLong,
                    "cpu_lamb.", what, ": segments must be an int64 [S, 3] tensor of (tensor, start, end) rows, "
                    "got ", segments.sizes(), " ", segments.scalar_type());
  const at::Tensor rows = segments.contiguous();
  const int64_t* s = rows.data_ptr<int64_t>();
  std::vector<Chunk> chunks;
  for (int64_t k = 0; k < rows.size(0); ++k) {
    const int64_t item = s[3 * k], start = s[3 * k + 1], end = s[3 * k + 2];
    TORCH_CHECK_VALUE(item >= 0 && item < static_cast<int64_t>(params.size()) && 0 <= start && start <= end &&
                          end <= params[item].numel(),
                      "cpu_lamb.", what, ": segment ", k, " = (", item, ", ", start, ", ", end, ") is outside the ",
                      params.size(), " tensors given (tensor index, 0 <= start <= end <= its numel)");
    for (int64_t lo = start; lo < end; lo += kChunk) chunks.push_back({item, k, lo, std::min(end, lo + kChunk)});
  }
  return chunks;
}

template <typename Body>
void run_chunks(const std::vector<Chunk>& chunks, int64_t total, Body body) {
  const int num_threads = std::max(1, at::get_num_threads());
  const int64_t count = static_cast<int64_t>(chunks.size());
#ifdef _OPENMP
  if (num_threads > 1 && total >= kSerialThreshold) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t k = 0; k < count; ++k) body(k);
    return;
  }
#endif
  (void)total;
  for (int64_t k = 0; k < count; ++k) body(k);
}

int64_t total_of(const std::vector<Chunk>& chunks) {
  int64_t total = 0;
  for (const Chunk& ch : chunks) total += ch.end - ch.start;
  return total;
}

at::Tensor lamb_moments(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& updates, const at::Tensor& segments, double beta1, double beta2,
                        double eps, double weight_decay, bool eps_inside_sqrt) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && updates.size() == n,
                    "cpu_lamb.lamb_moments: params, grads, exp_avgs, exp_avg_sqs and updates must have the same "
                    "length, got ", n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(), ", ",
                    updates.size());
  for (size_t i = 0; i < n; ++i) {
    const char* names[] = {"params", "grads", "exp_avgs", "exp_avg_sqs", "updates"};
    const at::Tensor* lists[] = {&params[i], &grads[i], &exp_avgs[i], &exp_avg_sqs[i], &updates[i]};
    for (int k = 0; k < 5; ++k) {
      check_fp32(*lists[k], "lamb_moments", names[k], i);
      TORCH_CHECK_VALUE(lists[k]->numel() == params[i].numel(), "cpu_lamb.lamb_moments: ", names[k], "[", i,
                        "] has ", lists[k]->numel(), " elements but params[", i, "] has ", params[i].numel());
    }
  }
  const std::vector<Chunk> chunks = make_chunks(segments, params, "lamb_moments");
  const Coeffs c{static_cast<float>(beta2), static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
                 static_cast<float>(eps), static_cast<float>(weight_decay), eps_inside_sqrt};
  std::vector<double> partial(2 * chunks.size(), 0.0);
  {
    pybind11::gil_scoped_release no_gil;
    run_chunks(chunks, total_of(chunks), [&](int64_t k) {
      const Chunk& ch = chunks[k];
      const int64_t s = ch.start;
      moments_span(params[ch.item].data_ptr<float>() + s, grads[ch.item].data_ptr<float>() + s,
                   exp_avgs[ch.item].data_ptr<float>() + s, exp_avg_sqs[ch.item].data_ptr<float>() + s,
                   updates[ch.item].data_ptr<float>() + s, ch.end - s, c, &partial[2 * k]);
    });
  }
  at::Tensor sums = at::zeros({segments.size(0), 2}, at::kDouble);
  double* out = sums.data_ptr<double>();
  for (size_t k = 0; k < chunks.size(); ++k) {  // in order: the same sums for any number of threads
    out[2 * chunks[k].segment] += partial[2 * k];
    out[2 * chunks[k].segment + 1] += partial[2 * k + 1];
  }
  return sums;
}

void lamb_apply(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& updates,
                const at::Tensor& segments, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(updates.size() == params.size(), "cpu_lamb.lamb_apply: params and updates must have the same "
                    "length, got ", params.size(), " and ", updates.size());
  for (size_t i = 0; i < params.size(); ++i) {
    check_fp32(params[i], "lamb_apply", "params", i);
    check_fp32(updates[i], "lamb_apply", "updates", i);
    TORCH_CHECK_VALUE(updates[i].numel() == params[i].numel(), "cpu_lamb.lamb_apply: updates[", i, "] has ",
                      updates[i].numel(), " elements but params[", i, "] has ", params[i].numel());
  }
  const std::vector<Chunk> chunks = make_chunks(segments, params, "lamb_apply");
  TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == segments.size(0) && scales.device().is_cpu(),
                    "cpu_lamb.lamb_apply: scales must be a 1-D CPU tensor with one value per segment (",
                    segments.size(0), "), got ", scales.sizes());
  const at::Tensor scale64 = scales.to(at::kDouble).contiguous();
  const double* scale = scale64.data_ptr<double>();
  pybind11::gil_scoped_release no_gil;
  run_chunks(chunks, total_of(chunks), [&](int64_t k) {
    const Chunk& ch = chunks[k];
    apply_span(params[ch.item].data_ptr<float>() + ch.start, updates[ch.item].data_ptr<float>() + ch.start,
               ch.end - ch.start, static_cast<float>(scale[ch.segment]));
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream native CPU LAMB (moments, update and its norms in one pass; see cpu_lamb.cpp)";
  m.def("lamb_moments", &lamb_moments, "Moments, update and per-segment sums of squares of p and u",
        py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("updates"),
        py::arg("segments"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("eps_inside_sqrt"));
  m.def("lamb_apply", &lamb_apply, "p -= scale[segment] * u over each segment", py::arg("params"),
        py::arg("updates"), py::arg("segments"), py::arg("scales"));
  m.def("simd_level", []() { return std::string(slipstream_simd::kLevel); },
        "SIMD level compiled in: avx512, avx2, neon or scalar");
}

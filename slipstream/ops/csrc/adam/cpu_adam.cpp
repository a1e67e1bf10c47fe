// Native CPU Adam/AdamW op (`slipstream_cpu_adam`): one fused, vectorized, OpenMP-parallel pass over all tensors.
//
// Interface (slipstream/ops/fallback/cpu_adam.py has the same functions):
//   adam_update(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay,
//               bias_correction, adamw_mode, low_precision_out) -> None
//   simd_level() -> "avx512" | "avx2" | "neon" | "scalar"
//
// [Note: cpu_adam memory traffic] Adam is bandwidth bound: per fp32 param it reads p, g, m, v and writes p, m, v
// (28 bytes). The kernel therefore makes exactly one pass, writes the optional low-precision copy (the ZeRO-Offload
// device copy) from registers in that same pass, and keeps m and v in fp32. Work is a flat list of all tensors
// split into one contiguous, cache-line aligned range per thread, so a whole step opens at most one OpenMP
// parallel region, and small steps run serially on the calling thread.
//
// Per element (torch.optim.Adam's formula; step_size = lr / (1 - beta1^t), bc2 = 1 / sqrt(1 - beta2^t), both 1
// without bias correction):
//   adamw_mode: p = p * (1 - lr * wd)            else: g = g + wd * p
//   m = m + (1 - beta1) * (g - m)                 (torch's lerp)
//   v = beta2 * v + (1 - beta2) * g * g
//   p = p - step_size * m / (sqrt(v) * bc2 + eps)
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
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
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float eps, neg_step_size, bc2, l2_decay, param_scale;
};

enum class ParamKind : int { F32 = 0, BF16 = 1 };
enum class OutKind : int { NONE = 0, BF16 = 1, F16 = 2 };

// One tensor of the step: raw pointers plus its kinds.
struct Item {
  void* p;
  const void* g;
  float* m;
  float* v;
  void* out;
  int64_t n;
  ParamKind pk;
  OutKind ok;
};

inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
inline void store1(float* p, int64_t i, float x) { p[i] = x; }
inline void store1(c10::BFloat16* p, int64_t i, float x) { p[i] = c10::BFloat16(x); }

template <OutKind OK>
inline void store_out1(void* out, int64_t i, float x) {
  if constexpr (OK == OutKind::BF16) {
    static_cast<c10::BFloat16*>(out)[i] = c10::BFloat16(x);
  } else if constexpr (OK == OutKind::F16) {
    static_cast<c10::Half*>(out)[i] = c10::Half(x);
  }
}

#if !defined(SLIPSTREAM_SIMD_SCALAR)
using slipstream_simd::Vec;
inline Vec::T loadv(const float* p) { return Vec::load(p); }
inline Vec::T loadv(const c10::BFloat16* p) { return Vec::load_bf16(reinterpret_cast<const uint16_t*>(p)); }
inline void storev(float* p, Vec::T x) { Vec::store(p, x); }
inline void storev(c10::BFloat16* p, Vec::T x) { Vec::store_bf16(reinterpret_cast<uint16_t*>(p), x); }

template <OutKind OK, bool NT>
inline void store_outv(void* out, Vec::T x) {
  uint16_t* o = static_cast<uint16_t*>(out);
  if constexpr (OK == OutKind::BF16) {
    NT ? Vec::stream_bf16(o, x) : Vec::store_bf16(o, x);
  } else if constexpr (OK == OutKind::F16) {
    NT ? Vec::stream_fp16(o, x) : Vec::store_fp16(o, x);
  }
}
#endif

// Elements ahead of the current position that the vector loop prefetches (1 KiB of each fp32 stream). With the
// divide and square root in the loop the hardware prefetchers alone leave 10-15% of the bandwidth unused
// (measured on a 2-core Sapphire Rapids VM: 650 -> 870 Mparams/s at 10M params, 1 thread). Prefetching past the
// end of an array is harmless (prefetches do not fault).
constexpr int64_t kPrefetchAhead = 256;

// Spans shorter than this write the low-precision copy with ordinary stores (it likely stays in cache).
constexpr int64_t kStreamMinElements = 1 << 14;

// Vector body over the leading multiple of Vec::W elements of [0, n); returns where the scalar tail starts.
// NT: write the low-precision copy with streaming stores (destination aligned to Vec::kNtAlign).
template <typename PT, OutKind OK, bool NT>
int64_t adam_span_vec(PT* p, const PT* g, float* m, float* v, void* out, int64_t n, const Coeffs& c) {
  int64_t i = 0;
#if !defined(SLIPSTREAM_SIMD_SCALAR)
  const Vec::T beta2 = Vec::set1(c.beta2), omb1 = Vec::set1(c.one_minus_beta1);
  const Vec::T omb2 = Vec::set1(c.one_minus_beta2), eps = Vec::set1(c.eps);
  const Vec::T neg_step = Vec::set1(c.neg_step_size), bc2 = Vec::set1(c.bc2);
  const Vec::T l2 = Vec::set1(c.l2_decay), pscale = Vec::set1(c.param_scale);
  for (; i + Vec::W <= n; i += Vec::W) {
    slipstream_simd::prefetch(p + i + kPrefetchAhead);
    slipstream_simd::prefetch(g + i + kPrefetchAhead);
    slipstream_simd::prefetch(m + i + kPrefetchAhead);
    slipstream_simd::prefetch(v + i + kPrefetchAhead);
    Vec::T pv = loadv(p + i);
    Vec::T gv = Vec::fma(pv, l2, loadv(g + i));
    pv = Vec::mul(pv, pscale);
    Vec::T mv = Vec::load(m + i);
    mv = Vec::fma(omb1, Vec::sub(gv, mv), mv);
    Vec::T vv = Vec::fma(Vec::mul(omb2, gv), gv, Vec::mul(Vec::load(v + i), beta2));
    Vec::T denom = Vec::fma(Vec::sqrt(vv), bc2, eps);
    pv = Vec::fma(neg_step, Vec::div(mv, denom), pv);
    Vec::store(m + i, mv);
    Vec::store(v + i, vv);
    storev(p + i, pv);
    if constexpr (OK != OutKind::NONE) {
      store_outv<OK, NT>(static_cast<uint16_t*>(out) + i, pv);
    }
  }
  if constexpr (NT) {
    Vec::nt_fence();
  }
#endif
  return i;
}

// Updates elements [0, n) of the given (already offset) pointers. The scalar tail uses the same operation order
// (explicit fma) as the vector body, so results do not depend on where a thread range starts.
template <typename PT, OutKind OK>
void adam_span(PT* p, const PT* g, float* m, float* v, void* out, int64_t n, const Coeffs& c) {
  int64_t i = 0;
#if !defined(SLIPSTREAM_SIMD_SCALAR)
  // The low-precision copy is write-only: streaming stores skip reading its lines first (see [Note: cpu_adam
  // memory traffic]); they need an aligned destination, which torch's allocator gives.
  const bool aligned = reinterpret_cast<uintptr_t>(out) % Vec::kNtAlign == 0;
  if (OK != OutKind::NONE && aligned && n >= kStreamMinElements) {
    i = adam_span_vec<PT, OK, true>(p, g, m, v, out, n, c);
  } else {
    i = adam_span_vec<PT, OK, false>(p, g, m, v, out, n, c);
  }
#endif
  for (; i < n; ++i) {
    float pv = load1(p, i);
    const float gv = std::fma(pv, c.l2_decay, load1(g, i));
    pv = pv * c.param_scale;
    const float mv = std::fma(c.one_minus_beta1, gv - m[i], m[i]);
    const float vv = std::fma(c.one_minus_beta2 * gv, gv, v[i] * c.beta2);
    const float denom = std::fma(std::sqrt(vv), c.bc2, c.eps);
    pv = std::fma(c.neg_step_size, mv / denom, pv);
    m[i] = mv;
    v[i] = vv;
    store1(p, i, pv);
    store_out1<OK>(out, i, pv);
  }
}

template <typename PT>
void dispatch_out(const Item& it, int64_t s, int64_t len, const Coeffs& c) {
  PT* p = static_cast<PT*>(it.p) + s;
  const PT* g = static_cast<const PT*>(it.g) + s;
  switch (it.ok) {
    case OutKind::NONE:
      adam_span<PT, OutKind::NONE>(p, g, it.m + s, it.v + s, nullptr, len, c);
      break;
    case OutKind::BF16:
      adam_span<PT, OutKind::BF16>(p, g, it.m + s, it.v + s, static_cast<c10::BFloat16*>(it.out) + s, len, c);
      break;
    case OutKind::F16:
      adam_span<PT, OutKind::F16>(p, g, it.m + s, it.v + s, static_cast<c10::Half*>(it.out) + s, len, c);
      break;
  }
}

// Processes the global element range [lo, hi) of the concatenation of all items.
void run_range(const std::vector<Item>& items, const std::vector<int64_t>& offsets, int64_t lo, int64_t hi,
               const Coeffs& c) {
  if (lo >= hi) return;
  size_t k = std::upper_bound(offsets.begin(), offsets.end(), lo) - offsets.begin() - 1;
  for (; k < items.size() && offsets[k] < hi; ++k) {
    const int64_t s = std::max(lo, offsets[k]) - offsets[k];
    const int64_t e = std::min(hi, offsets[k + 1]) - offsets[k];
    if (e <= s) continue;
    if (items[k].pk == ParamKind::F32) {
      dispatch_out<float>(items[k], s, e - s, c);
    } else {
      dispatch_out<c10::BFloat16>(items[k], s, e - s, c);
    }
  }
}

// Below this many elements in a whole step, one thread is faster than waking the OpenMP team.
constexpr int64_t kSerialThreshold = 1 << 16;
// Thread ranges start on multiples of this many elements (a 64-byte line for fp32 and bf16 alike).
constexpr int64_t kRangeAlign = 64;

void run_all(const std::vector<Item>& items, const std::vector<int64_t>& offsets, const Coeffs& c) {
  const int64_t total = offsets.back();
  const int num_threads = std::max(1, at::get_num_threads());
  if (num_threads == 1 || total < kSerialThreshold) {
    run_range(items, offsets, 0, total, c);
    return;
  }
#ifndef _OPENMP
  run_range(items, offsets, 0, total, c);  // built without OpenMP: serial
#else
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t tid = omp_get_thread_num();
    const int64_t nt = omp_get_num_threads();
    auto bound = [&](int64_t t) -> int64_t {
      if (t >= nt) return total;
      const int64_t b = (total / nt) * t + (total % nt) * t / nt;
      return std::min(total, (b / kRangeAlign) * kRangeAlign);
    };
    run_range(items, offsets, bound(tid), bound(tid + 1), c);
  }
#endif
}

// Python spelling of a dtype, so messages match the fallback's ("torch.bfloat16", not "BFloat16").
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

void check_tensor(const at::Tensor& t, const char* list, size_t idx) {
  TORCH_CHECK_VALUE(t.defined(), "cpu_adam.adam_update: ", list, "[", idx, "] is undefined (None)");
  TORCH_CHECK_VALUE(t.device().is_cpu(), "cpu_adam.adam_update: ", list, "[", idx, "] is on ", t.device(),
                    "; every tensor must be on the CPU (move it with .cpu())");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, "cpu_adam.adam_update: ", list, "[", idx, "] has layout ",
                    t.layout(), "; sparse tensors are not supported, densify the gradient first");
  TORCH_CHECK_VALUE(t.is_contiguous(), "cpu_adam.adam_update: ", list, "[", idx,
                    "] is not contiguous; pass t.contiguous() (params must be updated in place)");
}

std::vector<Item> build_items(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                              const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                              const std::vector<at::Tensor>& low_precision_out) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
                    "cpu_adam.adam_update: params, grads, exp_avgs and exp_avg_sqs must have the same length, got ",
                    n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size());
  TORCH_CHECK_VALUE(low_precision_out.empty() || low_precision_out.size() == n,
                    "cpu_adam.adam_update: low_precision_out must be empty or have one tensor per param (", n,
                    "), got ", low_precision_out.size());
  std::vector<Item> items;
  items.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor &p = params[i], &g = grads[i], &m = exp_avgs[i], &v = exp_avg_sqs[i];
    check_tensor(p, "params", i);
    check_tensor(g, "grads", i);
    check_tensor(m, "exp_avgs", i);
    check_tensor(v, "exp_avg_sqs", i);
    const auto pd = p.scalar_type();
    TORCH_CHECK_TYPE(pd == at::kFloat || pd == at::kBFloat16, "cpu_adam.adam_update: params[", i, "] has dtype ",
                     dtype_name(pd), "; supported param dtypes are float32 and bfloat16");
    TORCH_CHECK_TYPE(g.scalar_type() == pd, "cpu_adam.adam_update: grads[", i, "] has dtype ",
                     dtype_name(g.scalar_type()), " but params[", i, "] has dtype ", dtype_name(pd),
                     "; grads must have the param dtype");
    TORCH_CHECK_TYPE(m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "cpu_adam.adam_update: ",
                     "exp_avgs[", i, "] and exp_avg_sqs[", i, "] must be float32, got ",
                     dtype_name(m.scalar_type()), " and ", dtype_name(v.scalar_type()));
    const int64_t numel = p.numel();
    TORCH_CHECK_VALUE(g.numel() == numel && m.numel() == numel && v.numel() == numel, "cpu_adam.adam_update: ",
                      "params[", i, "] has ", numel, " elements but its grad/exp_avg/exp_avg_sq have ", g.numel(),
                      "/", m.numel(), "/", v.numel());
    Item it{p.data_ptr(), g.data_ptr(), m.data_ptr<float>(), v.data_ptr<float>(), nullptr, numel,
            pd == at::kFloat ? ParamKind::F32 : ParamKind::BF16, OutKind::NONE};
    if (!low_precision_out.empty()) {
      const at::Tensor& o = low_precision_out[i];
      check_tensor(o, "low_precision_out", i);
      TORCH_CHECK_TYPE(o.scalar_type() == at::kBFloat16 || o.scalar_type() == at::kHalf,
                       "cpu_adam.adam_update: low_precision_out[", i, "] has dtype ", dtype_name(o.scalar_type()),
                       "; it must be bfloat16 or float16");
      TORCH_CHECK_VALUE(o.numel() == numel, "cpu_adam.adam_update: low_precision_out[", i, "] has ", o.numel(),
                        " elements but params[", i, "] has ", numel);
      it.out = o.data_ptr();
      it.ok = o.scalar_type() == at::kBFloat16 ? OutKind::BF16 : OutKind::F16;
    }
    if (numel > 0) items.push_back(it);
  }
  return items;
}

Coeffs make_coeffs(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool bias_correction, bool adamw_mode) {
  TORCH_CHECK_VALUE(step >= 1, "cpu_adam.adam_update: step must be the 1-based step count (>= 1), got ", step);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  TORCH_CHECK_VALUE(bc1 > 0.0 && bc2 > 0.0, "cpu_adam.adam_update: bias correction is zero for beta1=", beta1,
                    ", beta2=", beta2, "; betas must be in [0, 1)");
  Coeffs c;
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(-lr / bc1);
  c.bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.l2_decay = adamw_mode ? 0.0f : static_cast<float>(weight_decay);
  c.param_scale = adamw_mode ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  return c;
}

void adam_update(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs, int64_t step,
                 double lr, double beta1, double beta2, double eps, double weight_decay, bool bias_correction,
                 bool adamw_mode, const std::vector<at::Tensor>& low_precision_out) {
  const Coeffs c = make_coeffs(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  const std::vector<Item> items = build_items(params, grads, exp_avgs, exp_avg_sqs, low_precision_out);
  if (items.empty()) return;
  std::vector<int64_t> offsets(items.size() + 1, 0);
  for (size_t k = 0; k < items.size(); ++k) offsets[k + 1] = offsets[k] + items[k].n;
  pybind11::gil_scoped_release no_gil;
  run_all(items, offsets, c);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Slipstream native CPU Adam/AdamW (one fused SIMD + OpenMP pass; see cpu_adam.cpp)";
  m.def("adam_update", &adam_update, "In-place Adam/AdamW over lists of CPU tensors", py::arg("params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("bias_correction"),
        py::arg("adamw_mode"), py::arg("low_precision_out"));
  m.def("simd_level", []() { return std::string(slipstream_simd::kLevel); },
        "SIMD level compiled in: avx512, avx2, neon or scalar");
}

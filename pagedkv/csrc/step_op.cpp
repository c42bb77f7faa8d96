// pagedkv::step_layer_attention: a compiled decode step's per-layer paged attention without a
// trip through Python (built and loaded by pagedkv/ops/step_op.py).
//
// A compiled step (pagedkv/model/compiled.py) calls this op once per layer from inductor's
// generated C++. For the layers whose kernel arguments the CPU backend has prepared for this
// step (a table, per calling thread, filled through the extern "C" functions below and cleared
// when the step ends) it checks the layer's q/k/v against them and calls the C kernel's
// pagedkv_write_attend directly (cpu_kernel.c: write the new K/V rows through slot_mapping,
// then attend over the block tables). Anything else (no prepared arguments, other shapes or
// dtypes, a non-contiguous or non-CPU tensor, a kernel error) goes to the Python op
// pagedkv::layer_attention, which takes the checked path and raises the library's errors.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

// one layer, constant while the engine's KV caches stay (set once per step from a cached array)
struct Layer {
  void *k, *v;      // the layer's key / value cache data
  float scale;      // softmax scale
  int32_t window;   // sliding window (tokens), 0 = off
  float cap;        // logits soft cap, 0 = off
  int32_t group;    // index of its cache geometry in this step's groups
};

// one cache geometry of this step: the kernel's prepared layer_args_t and what the call takes
struct Group {
  const void *args = nullptr;  // layer_args_t*, nullptr = not prepared (Python path)
  int32_t qdt = 0, hq = 0, hkv = 0, d = 0, n_tokens = 0;
};

using WriteAttend = int (*)(const void *, const void *, const void *, const void *, void *, void *, void *,
                            float, int, float);

WriteAttend g_kernel = nullptr;  // pagedkv_write_attend of the loaded C kernel (set once)
thread_local std::vector<Layer> t_layers;
thread_local std::vector<Group> t_groups;
thread_local int64_t t_direct = 0;  // layers run here (not through Python), since the last reset

at::Tensor python_path(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("pagedkv::layer_attention", "")
                             .typed<at::Tensor(const at::Tensor &, const at::Tensor &, const at::Tensor &, int64_t)>();
  return op.call(q, k, v, layer);
}

bool matches(const at::Tensor &t, const Group &g, int64_t heads) {
  return t.dim() == 3 && t.size(0) == g.n_tokens && t.size(1) == heads && t.size(2) == g.d && t.is_contiguous();
}

at::Tensor step_layer_attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, int64_t layer) {
  if (g_kernel == nullptr || layer < 0 || layer >= (int64_t)t_layers.size()) return python_path(q, k, v, layer);
  const Layer &L = t_layers[layer];
  if (L.group < 0 || L.group >= (int32_t)t_groups.size()) return python_path(q, k, v, layer);
  const Group &G = t_groups[L.group];
  const auto dtype = G.qdt == 0 ? at::kFloat : at::kBFloat16;
  if (G.args == nullptr || !q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu() ||
      q.scalar_type() != dtype || k.scalar_type() != dtype || v.scalar_type() != dtype || !matches(q, G, G.hq) ||
      !matches(k, G, G.hkv) || !matches(v, G, G.hkv))
    return python_path(q, k, v, layer);
  at::Tensor out = at::empty_like(q);
  const int rc = g_kernel(G.args, q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(), L.k, L.v,
                          out.mutable_data_ptr(), L.scale, L.window, L.cap);
  // a bad slot (-4) or argument is refused before anything is written; the checked path then
  // raises the library's error (after a failure inside the attention itself it rewrites the
  // same K/V rows and raises too)
  if (rc != 0) return python_path(q, k, v, layer);
  ++t_direct;
  return out;
}

}  // namespace

extern "C" {
// the C kernel's pagedkv_write_attend
void pagedkv_step_set_kernel(void *fn) { g_kernel = reinterpret_cast<WriteAttend>(fn); }
// this thread's step: n_layers layers (copied) and n_groups geometries, none prepared yet
void pagedkv_step_begin(int32_t n_layers, const Layer *layers, int32_t n_groups) {
  t_layers.assign(layers, layers + n_layers);
  t_groups.assign(n_groups < 0 ? 0 : n_groups, Group{});
}
// geometry `group` prepared: its layers run here from now until pagedkv_step_end
int32_t pagedkv_step_prepare(int32_t group, const void *args, int32_t qdt, int32_t hq, int32_t hkv, int32_t d,
                             int32_t n_tokens) {
  if (group < 0 || group >= (int32_t)t_groups.size()) return -1;
  t_groups[group] = Group{args, qdt, hq, hkv, d, n_tokens};
  return 0;
}
// the step is over: nothing prepared stays (its arguments point into this step's tensors)
void pagedkv_step_end(void) {
  t_layers.clear();
  t_groups.clear();
}
// layers this thread ran directly since the last call (and reset the count)
int64_t pagedkv_step_direct_calls(void) {
  const int64_t n = t_direct;
  t_direct = 0;
  return n;
}
}

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("step_layer_attention(Tensor q, Tensor k, Tensor v, int layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedkv, CompositeExplicitAutograd, m) {
  m.impl("step_layer_attention", &step_layer_attention);
}

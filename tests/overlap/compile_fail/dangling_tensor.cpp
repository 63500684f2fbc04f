// Must not compile for CASE 1..3: a temporary that owns its memory, passed where the exchange
// borrows rows until the call's streams ran, would dangle. CASE 0 (named tensors and views)
// must compile, so that the failures are about the temporaries and nothing else.
#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cstdint>
#include <span>
#include <vector>

std::vector<std::int32_t> make_ids() {
  return std::vector<std::int32_t>(4, 0);
}

int main() {
  weave::local_world world(1);
  weave::moe_options o;
  o.hidden = 8;
  o.max_tokens = 4;
  weave::moe_exchange<weave::local_communicator> layer(world.comm(0),
                                                       weave::placement::contiguous(2, 1), o);
  weave::host_stream compute, comm;
  weave::host_matrix<float> x(4, 8), y(4, 8);
  std::vector<std::int32_t> ids(4, 0);
  std::vector<float> weights(4, 1.0f);
#if CASE == 0
  auto h = layer.dispatch(x, ids, weights, compute, comm);
  layer.combine(h, y, compute, comm);
  auto g = layer.dispatch(x.view(), std::span(ids), std::span(weights), compute, comm);
  layer.combine(g, y.view(), compute, comm);
#elif CASE == 1
  auto h = layer.dispatch(weave::host_matrix<float>(4, 8), ids, weights, compute, comm);
#elif CASE == 2
  auto h = layer.dispatch(x, make_ids(), weights, compute, comm);
#elif CASE == 3
  auto h = layer.dispatch(x, ids, weights, compute, comm);
  layer.combine(h, weave::host_matrix<float>(4, 8), compute, comm);
#endif
  return 0;
}

#include <doctest/doctest.h>

#include <weave/placement/metrics.hpp>
#include <weave/placement/policies.hpp>
#include <weave/placement/trace.hpp>
#include <weave/placement/trace_io.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

weave::errc read_error(const std::string& text) {
  std::istringstream in(text);
  try {
    (void)weave::read_trace(in);
  } catch (const weave::error& e) {
    return e.code();
  }
  FAIL("malformed trace accepted: ", text);
  return weave::errc::internal;
}

// The error reading every layer of `text` gives; `internal` when it reads fine.
weave::errc layers_error(const std::string& text) {
  std::istringstream in(text);
  try {
    (void)weave::read_trace_layers(in);
  } catch (const weave::error& e) {
    return e.code();
  }
  return weave::errc::internal;
}

} // namespace

TEST_CASE("synthetic traces: k distinct valid ids per token, deterministic by seed") {
  weave::trace_options o;
  o.num_experts = 60;
  o.k = 4;
  o.tokens = 2000;
  o.zipf = 1.2;
  const auto a = weave::generate_trace(o);
  const auto b = weave::generate_trace(o);
  CHECK(a.ids == b.ids);
  o.seed = 2;
  CHECK(weave::generate_trace(o).ids != a.ids);
  REQUIRE(a.num_tokens() == 2000);
  for (std::size_t t = 0; t < a.num_tokens(); ++t) {
    const auto tok = a.token(t);
    const std::set<int> s(tok.begin(), tok.end());
    CHECK(s.size() == 4);
    CHECK(*s.begin() >= 0);
    CHECK(*s.rbegin() < 60);
  }
  CHECK(std::accumulate(a.popularity.begin(), a.popularity.end(), 0.0) == doctest::Approx(1.0));
  for (const auto bad :
       {weave::trace_options{8, 9}, weave::trace_options{8, 0}, weave::trace_options{8, 2, 10, 9},
        weave::trace_options{8, 2, 10, 2, 1.5}, weave::trace_options{8, 2, 10, 2, 0.5, -1.0}})
    CHECK_THROWS_AS(weave::generate_trace(bad), weave::error);
}

TEST_CASE("synthetic traces follow the requested Zipf exponent") {
  for (const double s : {0.5, 1.0, 1.5}) {
    weave::trace_options o;
    o.num_experts = 64;
    o.k = 1;
    o.clusters = 1;
    o.affinity = 0;
    o.zipf = s;
    o.tokens = 200000;
    o.seed = 5;
    const auto t = weave::generate_trace(o);
    std::vector<double> count(64, 0);
    for (const auto e : t.ids)
      ++count[static_cast<std::size_t>(e)];
    std::sort(count.begin(), count.end(), std::greater<>());
    // Least-squares slope of log(count) against log(rank) over the 32 most popular experts.
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const int n = 32;
    for (int r = 0; r < n; ++r) {
      const double x = std::log(r + 1.0), y = std::log(count[static_cast<std::size_t>(r)]);
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    const double slope = (n * sxy - sx * sy) / (n * sxx - sx * sx);
    CHECK(-slope == doctest::Approx(s).epsilon(0.05));
  }
}

TEST_CASE("synthetic traces co-activate inside clusters as much as the affinity asks") {
  for (const double a : {0.0, 0.5, 0.8, 1.0}) {
    weave::trace_options o;
    o.num_experts = 64;
    o.k = 6;
    o.clusters = 8;
    o.affinity = a;
    o.tokens = 20000;
    const auto t = weave::generate_trace(o);
    double inside = 0, pairs = 0;
    for (std::size_t tok = 0; tok < t.num_tokens(); ++tok) {
      const auto ids = t.token(tok);
      for (std::size_t i = 0; i < ids.size(); ++i)
        for (std::size_t j = i + 1; j < ids.size(); ++j) {
          pairs += 1;
          inside += t.cluster_of[static_cast<std::size_t>(ids[i])] ==
                    t.cluster_of[static_cast<std::size_t>(ids[j])];
        }
    }
    const double frac = inside / pairs;
    // Both experts of a pair come from the token's cluster with probability a²; otherwise a
    // pair falls in one cluster by chance, about 7/63 for uniform experts in 8 clusters of 8.
    const double chance = 7.0 / 63.0;
    MESSAGE("affinity ", a, ": within-cluster pair fraction ", frac);
    CHECK(frac >= a * a + (1 - a * a) * chance * 0.8 - 0.01);
    CHECK(frac <= a * a + (1 - a * a) * chance * 1.6 + 0.01);
  }
}

TEST_CASE("copies per token matches the random-placement formula and a naive count") {
  for (const auto& [E, k, D] : {std::tuple{64, 8, 4}, {64, 8, 16}, {60, 4, 4}, {256, 8, 32}}) {
    weave::trace_options o;
    o.num_experts = E;
    o.k = k;
    o.clusters = 1;
    o.affinity = 0;
    o.tokens = 40000;
    const auto t = weave::generate_trace(o);
    const auto topo = weave::topology::flat(D);
    const auto p = weave::place_contiguous(E, topo);
    const auto m = weave::evaluate_placement(p, topo, t.ids, k, 4096.0);
    CHECK(m.copies_per_token ==
          doctest::Approx(weave::copies_per_token_random(E, k, D)).epsilon(0.01));
    CHECK(m.copies_per_token >= weave::copies_per_token_lower_bound(E, k, D));
    CHECK(m.copies_per_token <= weave::copies_per_token_upper_bound(k, D));
    // Naive: a set of devices per token; the source is device t % D.
    double ct = 0, remote = 0;
    std::vector<double> rows(static_cast<std::size_t>(D), 0);
    for (std::size_t tok = 0; tok < t.num_tokens(); ++tok) {
      std::set<int> devs;
      for (const auto e : t.token(tok)) {
        devs.insert(p.device_of(e));
        ++rows[static_cast<std::size_t>(p.device_of(e))];
      }
      ct += static_cast<double>(devs.size());
      remote += static_cast<double>(devs.size()) - devs.count(static_cast<int>(tok % D));
    }
    const double n = static_cast<double>(t.num_tokens());
    CHECK(m.copies_per_token == doctest::Approx(ct / n));
    CHECK(m.remote_per_token == doctest::Approx(remote / n));
    CHECK(m.bytes_per_token == doctest::Approx(remote / n * 4096.0));
    CHECK(m.max_mean_load ==
          doctest::Approx(*std::max_element(rows.begin(), rows.end()) * D / (n * k)));
  }
  CHECK(weave::copies_per_token_lower_bound(64, 8, 32) == 4);
  CHECK(weave::copies_per_token_lower_bound(60, 4, 4) == 1);
  CHECK(weave::copies_per_token_upper_bound(8, 4) == 4);
  CHECK(weave::copies_per_token_random(8, 8, 4) == doctest::Approx(4.0));
  CHECK(weave::copies_per_token_random(8, 1, 4) == doctest::Approx(1.0));
  CHECK_THROWS_AS(weave::copies_per_token_random(10, 2, 4), weave::error);
  CHECK_THROWS_AS(weave::copies_per_token_lower_bound(4, 5, 2), weave::error);
}

TEST_CASE("cross-node copies and explicit source devices") {
  // 2 nodes x 2 devices, 2 experts each: expert e on device e / 2.
  const auto p = weave::placement::contiguous(8, 4);
  const auto topo = weave::topology::grid(2, 2);
  const std::vector<std::int32_t> ids = {0, 2, 4, 6, 1, 3, 0, -1};
  const std::vector<std::int32_t> src = {0, 3};
  const auto m = weave::evaluate_placement(p, topo, ids, 4, 1.0, src);
  // Token 0 from device 0: devices {0,1,2,3}, remote 3, remote nodes {1}.
  // Token 1 from device 3: devices {0,1}, remote 2, remote nodes {0}.
  CHECK(m.copies_per_token == doctest::Approx(3.0));
  CHECK(m.remote_per_token == doctest::Approx(2.5));
  CHECK(m.cross_node_per_token == doctest::Approx(1.0));
  CHECK(m.device_rows == std::vector<std::int64_t>{3, 2, 1, 1});
  CHECK_THROWS_AS(weave::evaluate_placement(p, topo, ids, 3), weave::error);
  CHECK_THROWS_AS(weave::evaluate_placement(p, topo, ids, 4, 1.0, std::vector<std::int32_t>{0}),
                  weave::error);
  CHECK_THROWS_AS(weave::evaluate_placement(p, topo, std::vector<std::int32_t>{0, 9}, 2),
                  weave::error);
}

TEST_CASE("trace files round-trip and accept comments, blank lines and CRLF") {
  weave::trace_options o;
  o.num_experts = 16;
  o.k = 3;
  o.tokens = 50;
  weave::routing_trace t = weave::generate_trace(o);
  t.ids[4] = -1;
  std::stringstream buf;
  weave::write_trace(buf, t);
  CHECK(weave::read_trace(buf) == t);

  const auto path = std::filesystem::temp_directory_path() / "weave_trace_roundtrip.txt";
  weave::write_trace_file(path.string(), t);
  CHECK(weave::read_trace_file(path.string()) == t);
  std::filesystem::remove(path);
  CHECK_THROWS_AS(weave::read_trace_file((path.string() + ".missing")), weave::error);

  std::istringstream in("# routing of layer 3\r\nweave-trace 1\r\nexperts\t4\n\nk 2\n"
                        "tokens 2\n# first token\n0 3\n  1\t-1\r\n");
  const auto r = weave::read_trace(in);
  CHECK(r.num_experts == 4);
  CHECK(r.k == 2);
  CHECK(r.ids == std::vector<std::int32_t>{0, 3, 1, -1});
}

TEST_CASE("malformed trace files get typed errors") {
  using weave::errc;
  const std::string head = "weave-trace 1\nexperts 4\nk 2\ntokens 2\n";
  CHECK(read_error("") == errc::invalid_argument);
  CHECK(read_error("weave-trac 1\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 3\nexperts 4\nk 2\ntokens 0\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 1\nexperts 0\nk 2\ntokens 0\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 1\nexperts 4\nk 5\ntokens 0\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 1\nexperts 4\ntokens 2\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 1\nexperts 4 5\nk 2\ntokens 0\n") == errc::invalid_argument);
  CHECK(read_error("weave-trace 1\nexperts 4\nk 2\ntokens -3\n") == errc::invalid_argument);
  CHECK(read_error(head + "0 1\n2 x\n") == errc::invalid_argument);
  CHECK(read_error(head + "0 1\n2 3.5\n") == errc::invalid_argument);
  CHECK(read_error(head + "0 1\n2\n") == errc::size_mismatch);
  CHECK(read_error(head + "0 1\n2 3 1\n") == errc::size_mismatch);
  CHECK(read_error(head + "0 1\n") == errc::size_mismatch);
  CHECK(read_error(head + "0 1\n2 3\n1 0\n") == errc::size_mismatch);
  CHECK(read_error(head + "0 1\n2 4\n") == errc::out_of_range);
  CHECK(read_error(head + "0 1\n-2 3\n") == errc::out_of_range);
  CHECK(read_error(head + "0 1\n99999999999999999999 3\n") == errc::invalid_argument);
  std::istringstream in(head + "0 1\n2 7\n");
  try {
    (void)weave::read_trace(in);
  } catch (const weave::error& e) {
    CHECK(e.message().find("line 6") != std::string::npos);
    CHECK(e.message().find("expert id 7") != std::string::npos);
  }
  std::ostringstream out;
  CHECK_THROWS_AS(weave::write_trace(out, weave::routing_trace{4, 2, {0, 1, 2}}), weave::error);
  CHECK_THROWS_AS(weave::write_trace(out, weave::routing_trace{4, 2, {0, 4}}), weave::error);
}

TEST_CASE("layered traces with scores round-trip exactly, and version 1 files read as one layer") {
  std::mt19937 rng(3);
  weave::layered_trace trace;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int l = 0; l < 3; ++l) {
    weave::routing_trace t;
    t.num_experts = 16;
    t.k = 3;
    std::vector<float> scores;
    for (int i = 0; i < 3 * 40; ++i) {
      t.ids.push_back(static_cast<std::int32_t>(rng() % 16));
      scores.push_back(i % 7 == 0 ? 0.0f : u(rng)); // any float comes back bit for bit
    }
    trace.layers.push_back(t);
    trace.scores.push_back(scores);
  }
  trace.layers[1].ids[5] = -1;
  std::stringstream buf;
  weave::write_trace_layers(buf, trace);
  CHECK(buf.str().rfind("weave-trace 2\nexperts 16\nk 3\nlayers 3\ntokens 40\nscores 1\nlayer 0\n",
                        0) == 0);
  CHECK(weave::read_trace_layers(buf) == trace);
  // read_trace takes a one-layer version 2 file (without its scores), not several layers.
  buf.clear();
  buf.seekg(0);
  CHECK_THROWS_AS(weave::read_trace(buf), weave::error);
  weave::layered_trace one{{trace.layers[2]}, {trace.scores[2]}};
  std::stringstream one_buf;
  weave::write_trace_layers(one_buf, one);
  CHECK(weave::read_trace(one_buf) == trace.layers[2]);
  // Without scores, through a file.
  trace.scores.clear();
  const auto path = std::filesystem::temp_directory_path() / "weave_trace_layers.txt";
  weave::write_trace_layers_file(path.string(), trace);
  CHECK(weave::read_trace_layers_file(path.string()) == trace);
  std::filesystem::remove(path);
  // A version 1 file is one layer without scores.
  std::istringstream v1("weave-trace 1\nexperts 4\nk 2\ntokens 1\n0 3\n");
  const auto read = weave::read_trace_layers(v1);
  REQUIRE(read.layers.size() == 1);
  CHECK(read.layers[0].ids == std::vector<std::int32_t>{0, 3});
  CHECK(read.scores.empty());
  // Hand-written: comments and blank lines between layers.
  std::istringstream hand("weave-trace 2\nexperts 4\nk 2\nlayers 2\ntokens 1\nscores 1\n"
                          "layer 0\n# a comment\n0 3 0.5 0.25\n\nlayer 1\n2 1 1e-3 0\n");
  const auto h = weave::read_trace_layers(hand);
  REQUIRE(h.layers.size() == 2);
  REQUIRE(h.scores.size() == 2);
  CHECK(h.scores[0] == std::vector<float>{0.5f, 0.25f});
  CHECK(h.layers[1].ids == std::vector<std::int32_t>{2, 1});
  CHECK(h.scores[1] == std::vector<float>{0.001f, 0.0f});
}

TEST_CASE("malformed layered traces get typed errors") {
  using weave::errc;
  const std::string head = "weave-trace 2\nexperts 4\nk 2\nlayers 2\ntokens 1\nscores 1\n";
  CHECK(layers_error(head + "layer 0\n0 1 0.5 0.5\nlayer 1\n2 3 0.5 0.5\n") == errc::internal);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 x\nlayer 1\n2 3 0.5 0.5\n") ==
        errc::invalid_argument);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 nan\nlayer 1\n2 3 0.5 0.5\n") ==
        errc::invalid_argument);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 inf\nlayer 1\n2 3 0.5 0.5\n") ==
        errc::invalid_argument);
  CHECK(layers_error(head + "layer 0\n0 1 0.5\nlayer 1\n2 3 0.5 0.5\n") == errc::size_mismatch);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 0.5\nlayer 2\n2 3 0.5 0.5\n") ==
        errc::invalid_argument);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 0.5\n") == errc::invalid_argument);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 0.5\nlayer 1\n") == errc::size_mismatch);
  CHECK(layers_error(head + "layer 0\n0 1 0.5 0.5\nlayer 1\n2 3 0.5 0.5\n1 1 0 0\n") ==
        errc::size_mismatch);
  CHECK(layers_error("weave-trace 2\nexperts 4\nk 2\nlayers 0\ntokens 1\nscores 1\n") ==
        errc::invalid_argument);
  CHECK(layers_error("weave-trace 2\nexperts 4\nk 2\nlayers 1\ntokens 1\nscores 2\n") ==
        errc::invalid_argument);
  std::ostringstream out;
  const weave::routing_trace a{4, 2, {0, 1}};
  const weave::routing_trace b{4, 2, {0, 1, 2, 3}};
  CHECK_THROWS_AS(weave::write_trace_layers(out, weave::layered_trace{{a, b}, {}}), weave::error);
  CHECK_THROWS_AS(weave::write_trace_layers(out, weave::layered_trace{{a}, {{0.5f}}}),
                  weave::error);
  CHECK_THROWS_AS(weave::write_trace_layers(out, weave::layered_trace{{a, a}, {{0.5f, 0.5f}}}),
                  weave::error);
  CHECK_THROWS_AS(
      weave::write_trace_layers(
          out, weave::layered_trace{{a}, {{0.5f, std::numeric_limits<float>::quiet_NaN()}}}),
      weave::error);
  CHECK_THROWS_AS(weave::write_trace_layers(out, weave::layered_trace{}), weave::error);
  CHECK(out.str().empty()); // nothing written before the checks
}

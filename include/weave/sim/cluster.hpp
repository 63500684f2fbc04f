//! \file
//! `cluster`: the machine a simulation runs on. Nodes × GPUs per node, one link class inside a
//! node (NVLink-class) and one between nodes (InfiniBand-class, one NIC per GPU), each with a
//! latency and a per-GPU, per-direction bandwidth, and the GPU's usable compute rate. Presets
//! for common clusters, and a small text format for the rest:
//! ```
//! weave-cluster 1               # magic and format version
//! name my-cluster               # optional, one word
//! nodes 64
//! gpus_per_node 8
//! intra 450 3                   # GB/s per GPU and direction, latency in us
//! inter 50 10
//! tflops 400                    # usable dense TFLOP/s per GPU (not the datasheet peak)
//! ```
//! Keys may come in any order, each once; `name` is optional, the others are required. A `#`
//! starts a comment that runs to the end of its line, on a line of its own or after the values
//! (so a name cannot contain `#`); blank lines are ignored. Fields are separated by spaces or
//! tabs; CRLF is accepted. Reading names the line of the first problem.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/topology.hpp"
#include "weave/plan/cost_model.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <istream>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace sim {

//! One link class: per-GPU, per-direction bandwidth and a per-message latency.
struct link_spec {
  double gbytes_per_s = 1.0; //!< GB/s (10^9 bytes) each GPU can send (and receive) on it
  double latency_us = 0.0;   //!< fixed cost of a message

  //! Time of a message of `bytes` bytes alone on the link.
  constexpr double time_us(double bytes) const noexcept {
    return latency_us + bytes * 1e-3 / gbytes_per_s;
  }
  //! The alpha-beta model of this link (`a2a_cost`).
  plan::a2a_cost cost() const { return plan::a2a_cost::from_bandwidth(latency_us, gbytes_per_s); }

  friend bool operator==(const link_spec&, const link_spec&) = default;
};

//! A cluster of `nodes` × `gpus_per_node` GPUs.
struct cluster {
  std::string name = "custom"; //!< shown in reports
  int nodes = 1;               //!< machines
  int gpus_per_node = 1;       //!< GPUs per machine (ranks are numbered node-major)
  link_spec intra{450.0, 3.0}; //!< between GPUs of one node
  link_spec inter{50.0, 10.0}; //!< between GPUs of different nodes (one NIC per GPU)
  double tflops = 400.0;       //!< usable dense TFLOP/s of one GPU

  int num_ranks() const noexcept { return nodes * gpus_per_node; }
  int node_of(int rank) const noexcept { return rank / gpus_per_node; }
  int local_of(int rank) const noexcept { return rank % gpus_per_node; }
  //! The link between ranks `a` and `b` (a != b).
  const link_spec& link(int a, int b) const noexcept {
    return node_of(a) == node_of(b) ? intra : inter;
  }
  //! The placement module's view of the machine.
  weave::topology topology() const { return weave::topology::grid(nodes, gpus_per_node); }

  //! Throws `errc::invalid_argument` for non-positive counts, bandwidths or compute rate, or a
  //! negative or non-finite latency; `errc::size_overflow` beyond 2^30 GPUs. Returns `*this`.
  const cluster& validated() const {
    weave::topology{nodes, gpus_per_node}.validated();
    for (const auto* l : {&intra, &inter}) {
      const char* which = l == &intra ? "intra" : "inter";
      WEAVE_EXPECT(weave::detail::is_finite(l->gbytes_per_s) && l->gbytes_per_s > 0,
                   errc::invalid_argument, "cluster '", name, "': ", which, " bandwidth ",
                   l->gbytes_per_s, " GB/s is not positive");
      WEAVE_EXPECT(weave::detail::is_finite(l->latency_us) && l->latency_us >= 0,
                   errc::invalid_argument, "cluster '", name, "': ", which, " latency ",
                   l->latency_us, " us is negative or not finite");
    }
    WEAVE_EXPECT(weave::detail::is_finite(tflops) && tflops > 0, errc::invalid_argument,
                 "cluster '", name, "': tflops = ", tflops);
    return *this;
  }

  //! `nodes` × 8 H100 SXM: NVLink 4 (450 GB/s per direction), one 400 Gb/s NIC per GPU.
  static cluster h100(int nodes) { return preset("h100", nodes, {450.0, 3.0}, {50.0, 10.0}, 400); }
  //! `nodes` × 8 H200: as H100 (same NVLink and NICs), more usable compute from faster memory.
  static cluster h200(int nodes) { return preset("h200", nodes, {450.0, 3.0}, {50.0, 10.0}, 450); }
  //! `nodes` × 8 A100 SXM: NVLink 3 (300 GB/s per direction), one 200 Gb/s NIC per GPU.
  static cluster a100(int nodes) { return preset("a100", nodes, {300.0, 4.0}, {25.0, 12.0}, 200); }
  //! The preset called `name` ("h100", "h200", "a100"); `errc::invalid_argument` otherwise.
  static cluster from_preset(std::string_view name, int nodes) {
    if (name == "h100")
      return h100(nodes);
    if (name == "h200")
      return h200(nodes);
    if (name == "a100")
      return a100(nodes);
    WEAVE_THROW(errc::invalid_argument, "unknown cluster preset '", name,
                "' (expected h100, h200 or a100)");
  }

  friend bool operator==(const cluster&, const cluster&) = default;

 private:
  static cluster preset(const char* name, int nodes, link_spec intra, link_spec inter,
                        double tflops) {
    cluster c;
    c.name = name;
    c.nodes = nodes;
    c.gpus_per_node = 8;
    c.intra = intra;
    c.inter = inter;
    c.tflops = tflops;
    c.validated();
    return c;
  }
};

namespace detail {

// The fields of a line, up to a `#` comment.
inline std::vector<std::string_view> cluster_fields(std::string_view line) {
  line = line.substr(0, line.find('#'));
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t'))
      ++i;
    std::size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t')
      ++j;
    if (j > i)
      out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

inline double cluster_number(std::string_view field, std::size_t number) {
  double v = 0;
  const auto r = std::from_chars(field.data(), field.data() + field.size(), v);
  WEAVE_EXPECT(r.ec == std::errc{} && r.ptr == field.data() + field.size() &&
                   weave::detail::is_finite(v),
               errc::invalid_argument, "cluster line ", number, ": '", field, "' is not a number");
  return v;
}

inline int cluster_count(std::string_view field, std::size_t number) {
  const double v = cluster_number(field, number);
  WEAVE_EXPECT(v == std::floor(v) && v >= 1 && v <= (1 << 30), errc::invalid_argument,
               "cluster line ", number, ": '", field, "' is not a positive integer");
  return static_cast<int>(v);
}

// A name the format can hold: one word, without the characters that end or comment a field.
inline bool cluster_name_ok(std::string_view name) {
  return !name.empty() && name.find_first_of(" \t\n\r#") == std::string_view::npos;
}

} // namespace detail

//! Reads a cluster in the format of the file comment. Throws `errc::invalid_argument` for a
//! bad magic or version, an unknown or repeated key, a missing required key, a wrong number of
//! values, a value that is not a valid number, or a name `write_cluster` cannot write (one
//! holding a '#' or a carriage return), naming the line.
inline cluster read_cluster(std::istream& in) {
  cluster c;
  std::string line;
  std::size_t number = 0;
  bool magic = false;
  std::vector<std::string> seen;
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    const auto f = detail::cluster_fields(line);
    if (f.empty())
      continue;
    const std::string key(f[0]);
    if (!magic) {
      WEAVE_EXPECT(key == "weave-cluster" && f.size() == 2, errc::invalid_argument, "cluster line ",
                   number, ": expected 'weave-cluster 1', got '", line, "'");
      WEAVE_EXPECT(f[1] == "1", errc::invalid_argument, "cluster format version ", f[1],
                   " is not supported (expected 1)");
      magic = true;
      continue;
    }
    for (const auto& s : seen)
      WEAVE_EXPECT(s != key, errc::invalid_argument, "cluster line ", number, ": key '", key,
                   "' given twice");
    seen.push_back(key);
    const std::size_t want = key == "intra" || key == "inter" ? 3 : 2;
    WEAVE_EXPECT(f.size() == want, errc::invalid_argument, "cluster line ", number, ": '", key,
                 "' takes ", want - 1, " value(s), got ", f.size() - 1);
    if (key == "name") {
      // What write_cluster can write back: no '#' (a comment) or carriage return inside.
      WEAVE_EXPECT(detail::cluster_name_ok(f[1]), errc::invalid_argument, "cluster line ", number,
                   ": name '", f[1], "' is not one word");
      c.name = std::string(f[1]);
    } else if (key == "nodes")
      c.nodes = detail::cluster_count(f[1], number);
    else if (key == "gpus_per_node")
      c.gpus_per_node = detail::cluster_count(f[1], number);
    else if (key == "intra" || key == "inter") {
      link_spec& l = key == "intra" ? c.intra : c.inter;
      l.gbytes_per_s = detail::cluster_number(f[1], number);
      l.latency_us = detail::cluster_number(f[2], number);
    } else if (key == "tflops")
      c.tflops = detail::cluster_number(f[1], number);
    else
      WEAVE_THROW(errc::invalid_argument, "cluster line ", number, ": unknown key '", key, "'");
  }
  WEAVE_EXPECT(magic, errc::invalid_argument, "cluster file is empty (no 'weave-cluster 1')");
  static constexpr std::string_view required[] = {"nodes", "gpus_per_node", "intra", "inter",
                                                  "tflops"};
  for (const std::string_view key : required)
    WEAVE_EXPECT(std::find(seen.begin(), seen.end(), key) != seen.end(), errc::invalid_argument,
                 "cluster file lacks the '", key, "' key");
  c.validated();
  return c;
}

//! Reads the cluster file at `path`; `errc::invalid_argument` if it cannot be opened.
inline cluster read_cluster_file(const std::string& path) {
  std::ifstream in(path);
  WEAVE_EXPECT(in.good(), errc::invalid_argument, "cannot open cluster file '", path, "'");
  return read_cluster(in);
}

//! Writes `c` in the format `read_cluster` reads (numbers round-trip exactly).
inline void write_cluster(std::ostream& out, const cluster& c) {
  c.validated();
  WEAVE_EXPECT(detail::cluster_name_ok(c.name), errc::invalid_argument, "cluster name '", c.name,
               "' is not one word");
  const auto old = out.precision(17);
  out << "weave-cluster 1\nname " << c.name << "\nnodes " << c.nodes << "\ngpus_per_node "
      << c.gpus_per_node << "\nintra " << c.intra.gbytes_per_s << ' ' << c.intra.latency_us
      << "\ninter " << c.inter.gbytes_per_s << ' ' << c.inter.latency_us << "\ntflops " << c.tflops
      << '\n';
  out.precision(old);
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "writing the cluster failed");
}

} // namespace sim
WEAVE_NAMESPACE_END

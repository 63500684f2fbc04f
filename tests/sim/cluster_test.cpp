#include <doctest/doctest.h>

#include <weave/sim/cluster.hpp>

#include <sstream>
#include <string>

using weave::errc;
using weave::sim::cluster;

namespace {

template <class F>
errc code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return errc::internal;
}

cluster parse(const std::string& text) {
  std::istringstream in(text);
  return weave::sim::read_cluster(in);
}

} // namespace

TEST_CASE("cluster presets describe 8-GPU nodes with the documented links") {
  const cluster h = cluster::h100(4);
  CHECK(h.num_ranks() == 32);
  CHECK(h.gpus_per_node == 8);
  CHECK(h.intra.gbytes_per_s == 450.0);
  CHECK(h.inter.gbytes_per_s == 50.0); // 400 Gb/s
  const cluster a = cluster::from_preset("a100", 2);
  CHECK(a.inter.gbytes_per_s == 25.0); // 200 Gb/s
  CHECK(a.intra.gbytes_per_s == 300.0);
  CHECK(cluster::from_preset("h200", 1).name == "h200");
  CHECK(code_of([] { cluster::from_preset("v100", 1); }) == errc::invalid_argument);
  CHECK(code_of([] { cluster::h100(0); }) == errc::invalid_argument);
  CHECK(h.node_of(15) == 1);
  CHECK(h.local_of(15) == 7);
  CHECK(&h.link(0, 7) == &h.intra);
  CHECK(&h.link(7, 8) == &h.inter);
  // 1 MB over NVLink: 3 us latency + 1e6 B / 450e9 B/s.
  CHECK(h.intra.time_us(1e6) == doctest::Approx(3.0 + 1e6 / 450e9 * 1e6));
}

TEST_CASE("cluster files round-trip and accept comments, any key order and CRLF") {
  cluster c;
  c.name = "lab";
  c.nodes = 3;
  c.gpus_per_node = 4;
  c.intra = {123.25, 1.5};
  c.inter = {12.5, 7.0 / 3.0};
  c.tflops = 0.1;
  std::ostringstream out;
  weave::sim::write_cluster(out, c);
  CHECK(parse(out.str()) == c);
  const cluster d = parse("# my cluster\r\nweave-cluster 1\r\n\ntflops 300\ninter 25 12\n"
                          "gpus_per_node 2\n  # indented comment\nintra 100 2\nnodes 5\n");
  CHECK(d.name == "custom");
  CHECK(d.nodes == 5);
  CHECK(d.gpus_per_node == 2);
  CHECK(d.intra == weave::sim::link_spec{100, 2});
  CHECK(d.inter == weave::sim::link_spec{25, 12});
  CHECK(d.tflops == 300);
}

TEST_CASE("a # comment may follow the values on a line, as docs/sim.md shows") {
  const cluster c = parse("weave-cluster 1   # magic and format version\n"
                          "name lab#no space before the comment\n"
                          "nodes 64\t# tab before the comment\n"
                          "gpus_per_node 8 #\n"
                          "intra 450 3         # GB/s per GPU and direction, latency in us\n"
                          "inter 50 10\r\n"
                          "tflops 400 # usable # and a second #\r\n");
  CHECK(c.name == "lab");
  CHECK(c.nodes == 64);
  CHECK(c.gpus_per_node == 8);
  CHECK(c.intra == weave::sim::link_spec{450, 3});
  CHECK(c.inter == weave::sim::link_spec{50, 10});
  CHECK(c.tflops == 400);
  // A comment ends the values: what it hides is not a value, and what is left must be complete.
  CHECK(code_of([] { parse("weave-cluster 1\nintra 450 # 3\n"); }) == errc::invalid_argument);
  CHECK(code_of([] { parse("weave-cluster # 1\n"); }) == errc::invalid_argument);
}

TEST_CASE("cluster files with bad content are rejected") {
  const std::string body = "nodes 2\ngpus_per_node 8\nintra 450 3\ninter 50 10\ntflops 400\n";
  CHECK(parse("weave-cluster 1\n" + body).num_ranks() == 16);
  CHECK(code_of([&] { parse(""); }) == errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 2\n" + body); }) == errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-trace 1\n" + body); }) == errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\n" + body + "nodes 3\n"); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\n" + body + "colour red\n"); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\nnodes 2\ngpus_per_node 8\n"); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\nnodes 2.5\n"); }) == errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\nnodes x\n"); }) == errc::invalid_argument);
  CHECK(code_of([&] { parse("weave-cluster 1\nintra 450\n"); }) == errc::invalid_argument);
  CHECK(code_of([&] {
          parse("weave-cluster 1\nnodes 2\ngpus_per_node 8\nintra 0 3\ninter 50 10\ntflops 4\n");
        }) == errc::invalid_argument);
  CHECK(code_of([&] {
          parse("weave-cluster 1\nnodes 2\ngpus_per_node 8\nintra 4 -1\ninter 50 10\ntflops 4\n");
        }) == errc::invalid_argument);
  CHECK(code_of([&] { weave::sim::read_cluster_file("/nonexistent/cluster.txt"); }) ==
        errc::invalid_argument);
  // Found by fuzzing (tests/fuzz/fuzz_cluster.cpp): a name write_cluster refuses to write (a
  // carriage return inside it, or none left once a comment is cut) was read, so a cluster read
  // did not write back. A '#' starts a comment: "my#cluster" is the name "my".
  CHECK(parse("weave-cluster 1\nname my#cluster\n" + body).name == "my");
  for (const char* name : {"a\rb", "#", " #x"}) {
    CAPTURE(name);
    CHECK(code_of([&] { parse("weave-cluster 1\nname " + std::string(name) + "\n" + body); }) ==
          errc::invalid_argument);
  }
  cluster spaced;
  spaced.name = "two words";
  std::ostringstream out;
  CHECK(code_of([&] { weave::sim::write_cluster(out, spaced); }) == errc::invalid_argument);
}

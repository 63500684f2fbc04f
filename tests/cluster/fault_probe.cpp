// fault_probe: MoE layers over MPI, one after another, each checked against its expected output,
// until a time is up or a layer fails; each rank then records what it saw. Run across an emulated
// cluster by fault_table.sh, which injects a node or link fault mid-run.
//
// Usage: fault_probe --out DIR [--seconds S] [--timeout-ms T] [--tokens N] [--hidden H]
// Each rank writes DIR/rank<R>: "<outcome> <layers correct> <longest layer, seconds (with the
// agreement to go on)> <wall seconds at the outcome> <detail>", outcome one of completed (every
// layer correct until the time was up), error (a weave::error: its errc in the detail), wrong (a
// layer's output differed: never acceptable). Wall seconds are CLOCK_REALTIME, comparable with the
// injector's. --timeout-ms sets mpi_options::timeout (default: the library's). After an error a
// rank waits 5 s (so every survivor records its own outcome) and exits without MPI_Finalize, which
// ends the job. After its third correct layer a rank creates DIR/running<R>.
#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

double wall_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

float scale_of(int expert) {
  return 1.0f + static_cast<float>(expert) / 16.0f;
}

struct args {
  std::string out;
  double seconds = 10;
  long timeout_ms = -1;
  std::size_t tokens = 512, hidden = 256;
};

args parse(int argc, char** argv) {
  args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--out")
      a.out = value;
    else if (key == "--seconds")
      a.seconds = std::stod(value);
    else if (key == "--timeout-ms")
      a.timeout_ms = std::stol(value);
    else if (key == "--tokens")
      a.tokens = std::stoul(value);
    else if (key == "--hidden")
      a.hidden = std::stoul(value);
    else {
      std::fprintf(stderr, "fault_probe: unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  if (a.out.empty()) {
    std::fprintf(stderr, "usage: fault_probe --out DIR [--seconds S] [--timeout-ms T]\n");
    std::exit(2);
  }
  return a;
}

double longest = 0; // the longest layer so far, seconds

void record(const args& a, int rank, const std::string& outcome, long layers,
            const std::string& detail) {
  std::ofstream f(a.out + "/rank" + std::to_string(rank));
  std::string line = detail;
  for (char& c : line)
    if (c == '\n')
      c = ' ';
  f << outcome << ' ' << layers << ' ' << std::to_string(longest) << ' '
    << std::to_string(wall_seconds()) << ' ' << line << '\n';
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const args a = parse(argc, argv);
  int rank = 0, ranks = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const int experts = 4 * ranks, k = 4;
  long layers = 0;
  try {
    weave::mpi_options mo;
    if (a.timeout_ms >= 0)
      mo.timeout = std::chrono::milliseconds(a.timeout_ms);
    weave::mpi_communicator comm(MPI_COMM_WORLD, mo);
    weave::moe_options o;
    o.k = k;
    o.hidden = a.hidden;
    o.max_tokens = a.tokens;
    o.chunks = 2;
    weave::moe_exchange<weave::mpi_communicator> ex(
        comm, weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), stream("comm");
    std::mt19937 rng(static_cast<std::uint32_t>(1000 + rank));
    std::normal_distribution<float> z(0.0f, 1.0f);
    std::vector<float> x(a.tokens * a.hidden), y(x.size()), want(x.size());
    std::vector<std::int32_t> ids(a.tokens * k);
    std::vector<float> weights(ids.size());
    std::vector<std::int32_t> all(static_cast<std::size_t>(experts));
    const auto expert = [&](const weave::expert_batch& b) {
      for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
        for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r) {
          const auto in = b.input.row_as<float>(static_cast<std::size_t>(r));
          const auto out = b.output.row_as<float>(static_cast<std::size_t>(r));
          for (std::size_t j = 0; j < in.size(); ++j)
            out[j] = in[j] * scale_of(b.experts[l]);
        }
    };
    const double end = wall_seconds() + a.seconds;
    // The ranks agree on each layer (a max over "time is up", through the communicator, so a
    // dead peer is a timeout and not a hang): clocks read at different moments must not leave
    // one rank starting a layer its peers will never join.
    const auto agree_to_stop = [&] {
      const std::int64_t mine = wall_seconds() >= end ? 1 : 0;
      std::int64_t any = 0;
      comm.all_reduce(stream, std::span<const std::int64_t>(&mine, 1),
                      std::span<std::int64_t>(&any, 1), weave::reduce_op::max);
      stream.synchronize();
      return any != 0;
    };
    double start = wall_seconds(); // of this layer, its agreement included
    while (!agree_to_stop()) {
      for (float& v : x)
        v = z(rng);
      for (std::size_t t = 0; t < a.tokens; ++t) {
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        for (int j = 0; j < k; ++j) {
          ids[t * k + j] = all[std::size_t(j)];
          weights[t * k + j] = 0.1f + 0.2f * static_cast<float>(j);
        }
        for (std::size_t h = 0; h < a.hidden; ++h) {
          float acc = 0;
          for (int j = 0; j < k; ++j)
            acc += weights[t * k + j] * scale_of(ids[t * k + j]) * x[t * a.hidden + h];
          want[t * a.hidden + h] = acc;
        }
      }
      ex.forward(weave::make_token_view(x, a.hidden), ids, weights,
                 weave::make_token_view(y, a.hidden), expert, compute, stream);
      ex.synchronize(compute, stream); // the one wait that reports a failure's root cause
      for (std::size_t i = 0; i < y.size(); ++i)
        if (!(std::fabs(y[i] - want[i]) <= 1e-5f * (1.0f + std::fabs(want[i])))) {
          record(a, rank, "wrong", layers,
                 "element " + std::to_string(i) + " of layer " + std::to_string(layers));
          std::this_thread::sleep_for(std::chrono::seconds(5));
          std::_Exit(3);
        }
      if (++layers == 3) // the injector waits for every rank's marker
        std::ofstream(a.out + "/running" + std::to_string(rank)) << "3 layers\n";
      longest = std::max(longest, wall_seconds() - start);
      start = wall_seconds();
    }
    record(a, rank, "completed", layers, "-");
  } catch (const weave::error& e) {
    record(a, rank, "error", layers, e.what()); // "weave <errc>: <message> (<where>)"
    std::this_thread::sleep_for(std::chrono::seconds(5));
    std::_Exit(1);
  }
  MPI_Finalize();
  return 0;
}

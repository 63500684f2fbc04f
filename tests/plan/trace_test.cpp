#include <doctest/doctest.h>

#include <weave/core/trace_writer.hpp>
#include <weave/plan/timeline.hpp>
#include <weave/plan/timeline_trace.hpp>

#include <cctype>
#include <cstdlib>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// A minimal strict JSON parser (objects, arrays, strings with escapes, numbers, literals),
// written independently of the writer, to read the trace back.
struct json {
  enum kind_t { null, boolean, number, string, array, object } kind = null;
  double num = 0;
  bool b = false;
  std::string str;
  std::vector<json> items;
  std::map<std::string, json> fields;

  const json& operator[](const std::string& k) const {
    auto it = fields.find(k);
    if (it == fields.end())
      throw std::runtime_error("missing field " + k);
    return it->second;
  }
  bool has(const std::string& k) const { return fields.count(k) != 0; }
};

class parser {
 public:
  explicit parser(const std::string& text)
      : s_(text) {}
  json parse_document() {
    json v = value();
    ws();
    if (i_ != s_.size())
      throw std::runtime_error("trailing characters");
    return v;
  }

 private:
  void ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_])))
      ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size())
      throw std::runtime_error("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c)
      throw std::runtime_error(std::string("expected ") + c + " at " + std::to_string(i_));
    ++i_;
  }
  json value() {
    const char c = peek();
    if (c == '{')
      return object();
    if (c == '[')
      return array();
    if (c == '"') {
      json v;
      v.kind = json::string;
      v.str = string();
      return v;
    }
    if (s_.compare(i_, 4, "true") == 0 || s_.compare(i_, 5, "false") == 0 ||
        s_.compare(i_, 4, "null") == 0)
      throw std::runtime_error("literals are not expected in a trace");
    return number();
  }
  json object() {
    json v;
    v.kind = json::object;
    expect('{');
    if (peek() == '}') {
      ++i_;
      return v;
    }
    for (;;) {
      if (peek() != '"')
        throw std::runtime_error("object key must be a string");
      std::string key = string();
      expect(':');
      if (v.fields.count(key))
        throw std::runtime_error("duplicate key " + key);
      v.fields[key] = value();
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect('}');
      return v;
    }
  }
  json array() {
    json v;
    v.kind = json::array;
    expect('[');
    if (peek() == ']') {
      ++i_;
      return v;
    }
    for (;;) {
      v.items.push_back(value());
      if (peek() == ',') {
        ++i_;
        continue;
      }
      expect(']');
      return v;
    }
  }
  std::string string() {
    expect('"');
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      const char c = s_[i_++];
      if (static_cast<unsigned char>(c) < 0x20)
        throw std::runtime_error("raw control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      const char e = s_.at(i_++);
      switch (e) {
      case '"':
      case '\\':
      case '/':
        out += e;
        break;
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'u': {
        const unsigned code = std::stoul(s_.substr(i_, 4), nullptr, 16);
        i_ += 4;
        if (code >= 0x80)
          throw std::runtime_error("non-ASCII escape not expected");
        out += static_cast<char>(code);
        break;
      }
      default:
        throw std::runtime_error("bad escape");
      }
    }
    expect('"');
    return out;
  }
  json number() {
    ws();
    const std::size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-')
      ++i_;
    while (i_ < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                              s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-'))
      ++i_;
    if (i_ == start)
      throw std::runtime_error("expected a value at " + std::to_string(i_));
    json v;
    v.kind = json::number;
    v.num = std::stod(s_.substr(start, i_ - start));
    return v;
  }

  const std::string& s_;
  std::size_t i_ = 0;
};

json parse(const std::string& s) {
  return parser(s).parse_document();
}

} // namespace

TEST_CASE("trace_writer writes valid Chrome-trace JSON with every field") {
  weave::trace_writer w;
  w.name_process(3, "rank \"three\"");
  w.name_thread(3, 1, "comm");
  const std::string tricky = "a\"b\\c\nd\te\x01";
  w.add({tricky, "a2a", 3, 1, 12.5, 4.25, {{"bytes", "1024"}}});
  w.add({"plain", "compute", 0, 0, 0.0, 0.0, {}});
  const json doc = parse(w.str());
  REQUIRE(doc.kind == json::object);
  const json& ev = doc["traceEvents"];
  REQUIRE(ev.kind == json::array);
  REQUIRE(ev.items.size() == 4); // 2 metadata + 2 events

  const json& pname = ev.items[0];
  CHECK(pname["ph"].str == "M");
  CHECK(pname["name"].str == "process_name");
  CHECK(pname["pid"].num == 3);
  CHECK(pname["args"]["name"].str == "rank \"three\"");
  const json& tname = ev.items[1];
  CHECK(tname["name"].str == "thread_name");
  CHECK(tname["tid"].num == 1);
  CHECK(tname["args"]["name"].str == "comm");

  const json& e = ev.items[2];
  CHECK(e["name"].str == tricky); // escapes round-trip
  CHECK(e["cat"].str == "a2a");
  CHECK(e["ph"].str == "X");
  CHECK(e["pid"].num == 3);
  CHECK(e["tid"].num == 1);
  CHECK(e["ts"].num == 12.5);
  CHECK(e["dur"].num == 4.25);
  CHECK(e["args"]["bytes"].str == "1024");
  CHECK_FALSE(ev.items[3].has("args"));
}

TEST_CASE("append_timeline exports every task of a simulated schedule") {
  using namespace weave::plan;
  graph g;
  const auto a = g.add_compute("attn", {0, 4});
  const auto x = g.add_a2a("dispatch", 1e3, op_cost{1, 4}, {a});
  g.add_compute("experts", {0, 2}, {x});
  partition_plan p;
  p.order = g.topological_order();
  p.ranges = {{0, 3, 2}};
  const auto s = make_schedule(g, p);
  const auto t = weave::plan::simulate(s, 2);
  weave::trace_writer w;
  append_timeline(w, g, s, t, "predicted", 10);
  const json doc = parse(w.str());
  const auto& ev = doc["traceEvents"].items;
  std::size_t events = 0, names = 0;
  for (const json& e : ev) {
    if (e["ph"].str == "M") {
      ++names;
      continue;
    }
    REQUIRE(e["ph"].str == "X");
    const auto rank = static_cast<std::size_t>(e["pid"].num) - 10;
    REQUIRE(rank < 2);
    // Events come in rank-major task order; recover the task from the position.
    const std::size_t i = events % s.size();
    CHECK(rank == events / s.size());
    CHECK(e["tid"].num == static_cast<double>(s[i].stream));
    CHECK(e["ts"].num == doctest::Approx(t.at(rank, i).begin_us).epsilon(1e-6));
    CHECK(e["dur"].num ==
          doctest::Approx(t.at(rank, i).end_us - t.at(rank, i).begin_us).epsilon(1e-6));
    CHECK(e["cat"].str == to_string(g.at(s[i].op).kind));
    CHECK(e["name"].str.find(g.at(s[i].op).name) == 0);
    ++events;
  }
  CHECK(events == 2 * s.size());
  CHECK(names == 2 * 3); // per rank: process + compute + comm
}

TEST_CASE("trace_writer rejects times JSON cannot hold and unwritable files") {
  weave::trace_writer w;
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  CHECK(code_of([&] {
          w.add({"neg", "c", 0, 0, 0.0, -1.0, {}});
        }) == weave::errc::invalid_argument);
  CHECK(code_of([&] {
          w.add({"inf", "c", 0, 0, std::numeric_limits<double>::infinity(), 1.0, {}});
        }) == weave::errc::invalid_argument);
  CHECK(w.size() == 0);
  CHECK(code_of([&] { w.write_file("/nonexistent-dir/trace.json"); }) ==
        weave::errc::invalid_state);
}

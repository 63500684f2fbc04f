// The construction's agreement (`config_fingerprint::find_disagreement`, and the statuses beside
// the fingerprints): whatever the other ranks send, every rank either agrees, names the first
// field that differs, names a peer's failure, or refuses words no rank writes with
// `errc::protocol` naming the rank; a message never reads past the words.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/comm/agreement.hpp>
#include <weave/core/dtype.hpp>
#include <weave/overlap/detail/layer_agreement.hpp>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int ranks = in.ConsumeIntegralInRange<int>(1, 6);
  const int self = in.ConsumeIntegralInRange<int>(0, ranks - 1);
  // This rank's fingerprint: an MoE layer's (every field format), or a small one.
  weave::moe_options o;
  o.k = 2;
  o.hidden = 64;
  o.max_tokens = 16;
  const weave::config_fingerprint mine =
      in.ConsumeBool()
          ? weave::layer_fingerprint("moe_exchange", weave::placement::contiguous(8, 2), o)
          : weave::config_fingerprint("small").add("a", 1).add_flag("b", true);
  std::vector<std::int64_t> own = mine.words();
  own.resize(weave::agreement_words, 0);
  std::vector<std::int64_t> all;
  bool changed = false;
  for (int r = 0; r < ranks; ++r)
    for (std::size_t i = 0; i < weave::agreement_words; ++i) {
      // This rank's words are its own; a peer's are its words, changed here and there.
      std::int64_t w = own[i];
      if (r != self && in.ConsumeIntegralInRange<int>(0, 7) == 0)
        w = in.ConsumeBool() ? in.ConsumeIntegral<std::int64_t>()
                             : in.ConsumeIntegralInRange<std::int64_t>(-1, 40);
      changed = changed || w != own[i];
      all.push_back(w);
    }
  // The statuses (what agree_on_config reads first, after the fingerprint and the layer serial),
  // then the fingerprints.
  const std::exception_ptr peer =
      weave::detail::peer_failure_in(all, weave::fingerprint_words + 1, ranks, self,
                                     "fuzz construction", weave::detail::status_decoder(ranks));
  if (peer) {
    try {
      std::rethrow_exception(peer);
    } catch (const weave::peer_error& e) {
      WEAVE_FUZZ_CHECK(e.origin().rank >= 0 && e.origin().rank < ranks);
    } catch (const weave::error& e) {
      WEAVE_FUZZ_CHECK(e.code() == weave::errc::protocol);
    }
  }
  WEAVE_FUZZ_CHECK(changed || !peer); // ranks that send what this one does agree
  std::optional<weave::config_disagreement> verdict;
  const bool read =
      weave_fuzz::accepted({weave::errc::protocol}, [&] { verdict = mine.find_disagreement(all); });
  WEAVE_FUZZ_CHECK(changed || (read && !verdict));
  if (read) {
    if (verdict) {
      WEAVE_FUZZ_CHECK(verdict->field <= weave::config_fingerprint::max_fields);
      WEAVE_FUZZ_CHECK(!verdict->message.empty());
    } else { // agreement: every rank sent this rank's fingerprint
      for (int r = 0; r < ranks; ++r)
        for (std::size_t i = 0; i < weave::fingerprint_words; ++i)
          WEAVE_FUZZ_CHECK(all[static_cast<std::size_t>(r) * weave::agreement_words + i] == own[i]);
    }
  }
  return 0;
}

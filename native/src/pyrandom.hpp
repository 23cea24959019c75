// Python's random.Random (MT19937, CPython's seeding of an int and its shuffle), so that a
// native device orders its data exactly as the Python device does (edge_sdk/data.py
// train_val_split, moe_model/train.py train_local): same seed, same split, same batches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fedmoe {

class PyRandom {
 public:
  /// As `random.Random(seed)` for an int `seed` (CPython's init_by_array over the 32-bit
  /// words of |seed|, least significant first).
  explicit PyRandom(uint64_t seed);
  /// `random.getrandbits(k)` for 1 <= k <= 32.
  uint32_t getrandbits(int k);
  /// `random.Random._randbelow(n)` for n >= 1.
  uint64_t randbelow(uint64_t n);
  /// `random.shuffle(x)` in place.
  template <class T>
  void shuffle(std::vector<T>& x) {
    for (size_t i = x.size(); i-- > 1;) {
      const size_t j = static_cast<size_t>(randbelow(i + 1));
      std::swap(x[i], x[j]);
    }
  }

 private:
  uint32_t next();
  uint32_t mt_[624];
  int mti_ = 625;
};

}  // namespace fedmoe

#include "pyrandom.hpp"

#include <stdexcept>

namespace fedmoe {

PyRandom::PyRandom(uint64_t seed) {
  // init_genrand(19650218), then init_by_array(key) as CPython's _randommodule.c
  mt_[0] = 19650218u;
  for (mti_ = 1; mti_ < 624; ++mti_)
    mt_[mti_] = 1812433253u * (mt_[mti_ - 1] ^ (mt_[mti_ - 1] >> 30)) + static_cast<uint32_t>(mti_);
  std::vector<uint32_t> key;
  for (uint64_t s = seed; s; s >>= 32) key.push_back(static_cast<uint32_t>(s & 0xffffffffu));
  if (key.empty()) key.push_back(0);
  size_t i = 1, j = 0;
  const size_t n = 624, len = key.size();
  for (size_t k = n > len ? n : len; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1664525u)) + key[j] + static_cast<uint32_t>(j);
    ++i, ++j;
    if (i >= n) mt_[0] = mt_[n - 1], i = 1;
    if (j >= len) j = 0;
  }
  for (size_t k = n - 1; k; --k) {
    mt_[i] = (mt_[i] ^ ((mt_[i - 1] ^ (mt_[i - 1] >> 30)) * 1566083941u)) - static_cast<uint32_t>(i);
    ++i;
    if (i >= n) mt_[0] = mt_[n - 1], i = 1;
  }
  mt_[0] = 0x80000000u;
  mti_ = 624;
}

uint32_t PyRandom::next() {
  static const uint32_t mag01[2] = {0u, 0x9908b0dfu};
  if (mti_ >= 624) {
    int kk = 0;
    for (; kk < 624 - 397; ++kk) {
      const uint32_t y = (mt_[kk] & 0x80000000u) | (mt_[kk + 1] & 0x7fffffffu);
      mt_[kk] = mt_[kk + 397] ^ (y >> 1) ^ mag01[y & 1u];
    }
    for (; kk < 623; ++kk) {
      const uint32_t y = (mt_[kk] & 0x80000000u) | (mt_[kk + 1] & 0x7fffffffu);
      mt_[kk] = mt_[kk + (397 - 624)] ^ (y >> 1) ^ mag01[y & 1u];
    }
    const uint32_t y = (mt_[623] & 0x80000000u) | (mt_[0] & 0x7fffffffu);
    mt_[623] = mt_[396] ^ (y >> 1) ^ mag01[y & 1u];
    mti_ = 0;
  }
  uint32_t y = mt_[mti_++];
  y ^= (y >> 11);
  y ^= (y << 7) & 0x9d2c5680u;
  y ^= (y << 15) & 0xefc60000u;
  y ^= (y >> 18);
  return y;
}

uint32_t PyRandom::getrandbits(int k) {
  if (k < 1 || k > 32) throw std::invalid_argument("getrandbits: 1 <= k <= 32");
  return next() >> (32 - k);
}

uint64_t PyRandom::randbelow(uint64_t n) {
  if (n == 0) return 0;
  int k = 0;
  for (uint64_t m = n; m; m >>= 1) ++k;  // n.bit_length()
  if (k > 32) throw std::invalid_argument("randbelow: n beyond 2^32");
  uint64_t r = getrandbits(k);
  while (r >= n) r = getrandbits(k);
  return r;
}

}  // namespace fedmoe

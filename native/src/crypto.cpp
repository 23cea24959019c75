#include "crypto.hpp"

#include <sodium.h>

#include <cstring>
#include <stdexcept>

namespace fedmoe {

namespace {
void init() {
  static const bool ok = sodium_init() >= 0;
  if (!ok) throw std::runtime_error("libsodium failed to initialise");
}
std::string hex(const uint8_t* d, size_t n) {
  std::string out(2 * n + 1, '\0');
  sodium_bin2hex(out.data(), out.size(), d, n);
  out.pop_back();
  return out;
}
}  // namespace

static_assert(sizeof(crypto_hash_sha256_state) <= 128, "Sha256 state buffer too small");

std::string sha256_hex(const uint8_t* data, size_t n) {
  init();
  uint8_t d[crypto_hash_sha256_BYTES];
  crypto_hash_sha256(d, data, n);
  return hex(d, sizeof d);
}

Sha256::Sha256() {
  init();
  crypto_hash_sha256_init(reinterpret_cast<crypto_hash_sha256_state*>(state_.data()));
}

void Sha256::update(const uint8_t* data, size_t n) {
  crypto_hash_sha256_update(reinterpret_cast<crypto_hash_sha256_state*>(state_.data()), data, n);
}

std::string Sha256::hex() {
  uint8_t d[crypto_hash_sha256_BYTES];
  crypto_hash_sha256_final(reinterpret_cast<crypto_hash_sha256_state*>(state_.data()), d);
  return fedmoe::hex(d, sizeof d);
}

std::string base64_encode(const uint8_t* data, size_t n) {
  init();
  std::string out(sodium_base64_ENCODED_LEN(n, sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(out.data(), out.size(), data, n, sodium_base64_VARIANT_ORIGINAL);
  out.resize(std::strlen(out.c_str()));
  return out;
}

std::vector<uint8_t> base64_decode(const std::string& text) {
  init();
  std::vector<uint8_t> out(text.size() * 3 / 4 + 3);
  size_t len = 0;
  const char* end = nullptr;
  if (sodium_base642bin(out.data(), out.size(), text.data(), text.size(), nullptr, &len, &end,
                        sodium_base64_VARIANT_ORIGINAL) != 0 ||
      end != text.data() + text.size())
    throw std::runtime_error("not standard base64");
  out.resize(len);
  return out;
}

std::string random_hex(size_t n) {
  init();
  std::vector<uint8_t> b(n);
  randombytes_buf(b.data(), n);
  return hex(b.data(), n);
}

Signer::Signer(const std::string& seed_b64) {
  init();
  const auto seed = base64_decode(seed_b64);
  if (seed.size() != crypto_sign_SEEDBYTES) throw std::runtime_error("signing key is not 32 bytes");
  crypto_sign_seed_keypair(public_.data(), secret_.data(), seed.data());
}

std::string Signer::sign_b64(const std::string& message) const {
  uint8_t sig[crypto_sign_BYTES];
  crypto_sign_detached(sig, nullptr, reinterpret_cast<const uint8_t*>(message.data()), message.size(), secret_.data());
  return base64_encode(sig, sizeof sig);
}

std::string Signer::public_key_b64() const { return base64_encode(public_.data(), public_.size()); }

std::string signed_text(const std::string& kind, const std::string& device_id, uint64_t round,
                        const std::string& upload_id, const std::string& sha256) {
  return "fedmoe/v1|" + kind + "|" + device_id + "|" + std::to_string(round) + "|" + upload_id + "|" + sha256;
}

}  // namespace fedmoe

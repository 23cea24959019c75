// Hashes, encodings and signatures of the protocol (PROTOCOL.md §6.1, §8), through libsodium:
// SHA-256 (lowercase hex), standard base64 with padding (RFC 4648 §4), Ed25519 (RFC 8032).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace fedmoe {

/// Lowercase hex SHA-256 of `n` bytes at `data`.
std::string sha256_hex(const uint8_t* data, size_t n);
inline std::string sha256_hex(const std::vector<uint8_t>& b) { return sha256_hex(b.data(), b.size()); }
inline std::string sha256_hex(const std::string& s) {
  return sha256_hex(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

/// Incremental SHA-256 (a file hashed as it is downloaded).
class Sha256 {
 public:
  Sha256();
  void update(const uint8_t* data, size_t n);
  std::string hex();  // the digest; the object is spent afterwards

 private:
  alignas(64) std::array<uint8_t, 128> state_{};  // crypto_hash_sha256_state (104 bytes)
};

/// Standard base64 with padding of `n` bytes.
std::string base64_encode(const uint8_t* data, size_t n);
/// Decodes standard base64 with padding; throws std::runtime_error on any other character.
std::vector<uint8_t> base64_decode(const std::string& text);

/// `n` random bytes as 2n lowercase hex digits (the upload id: 16 digits).
std::string random_hex(size_t n);

/// An Ed25519 signer from a raw 32-byte seed (the `signing_key` of `fedmoe provision`'s
/// credentials, base64). Throws std::runtime_error when the key is not 32 bytes of base64.
class Signer {
 public:
  explicit Signer(const std::string& seed_b64);
  /// Base64 of the 64-byte detached signature of `message`.
  std::string sign_b64(const std::string& message) const;
  /// Base64 of the 32-byte public key.
  std::string public_key_b64() const;

 private:
  std::array<uint8_t, 64> secret_{};
  std::array<uint8_t, 32> public_{};
};

/// The bytes a device signs (§8): `fedmoe/v1|{kind}|{device_id}|{round}|{upload_id}|{sha256}`.
std::string signed_text(const std::string& kind, const std::string& device_id, uint64_t round,
                        const std::string& upload_id, const std::string& sha256);

}  // namespace fedmoe

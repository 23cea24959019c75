// Tensor payloads of the protocol (PROTOCOL.md §6.5-§6.7): the adapter state a device
// receives and the update it sends. Decoding takes every weight format of §6.6 (fp32, fp16,
// bf16, int8 with per-row or per-column scales, nf4) and the compressed form of §6.5a
// (FMZ1zlib), and gives fp32 tensors; encoding writes fp32 (optionally compressed).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fedmoe {

/// An fp32 tensor: shape and row-major values.
struct FloatTensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};
using FloatTensors = std::map<std::string, FloatTensor>;

/// Whether a payload starts with the compressed magic `FMZ1zlib` (§6.5a).
bool is_compressed(const std::vector<uint8_t>& payload);

/// The payload inflated from its FMZ1zlib form, at most `max_bytes`; throws
/// std::runtime_error when the stream is malformed or truncated, inflates to more, or is
/// followed by further bytes.
std::vector<uint8_t> inflate_payload(const std::vector<uint8_t>& payload, size_t max_bytes);

/// `payload` in FMZ1zlib form (zlib level 6).
std::vector<uint8_t> deflate_payload(const std::vector<uint8_t>& payload);

/// A decoded payload: its tensors in fp32 and its `fedmoe.encoding` (`state` or `delta`).
struct Decoded {
  FloatTensors tensors;
  std::string encoding = "state";
};

/// Decodes a payload (compressed or plain) of at most `max_bytes` (inflated) to fp32
/// tensors, checking every rule of §6.5/§6.6 (header, dtypes, quantization side tensors and
/// their shapes, finite values). Integer tensors outside a quantization are refused (the
/// device takes no extra tensors). Throws std::runtime_error with the reason.
Decoded decode_payload(const std::vector<uint8_t>& payload, size_t max_bytes);

/// An fp32 payload of `tensors` (format `fp32`, encoding `state`), compressed when `compress`.
std::vector<uint8_t> encode_fp32(const FloatTensors& tensors, bool compress);

/// The 16 NF4 levels of §6.6.
extern const float kNF4[16];

}  // namespace fedmoe

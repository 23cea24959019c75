// safetensors files, per the format's specification (huggingface/safetensors, README
// "Format"): an 8-byte little-endian header length N, N bytes of JSON
// {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {...}}, then
// the tensor data, each tensor's bytes at [begin, end) after the header, row-major,
// little-endian. Reading checks every offset against the file; nothing is trusted.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fedmoe {

/// One tensor of a safetensors file: dtype as the format names it ("F32", "I64", "I8",
/// "U8", "BF16", ...), shape, and its bytes (owned by the File it came from).
struct TensorView {
  std::string dtype;
  std::vector<int64_t> shape;
  uint8_t* data = nullptr;
  size_t nbytes = 0;
};

/// Bytes per element of a safetensors dtype; throws std::runtime_error for an unknown one.
size_t dtype_size(const std::string& dtype);

/// A safetensors file read into memory.
class SafetensorsFile {
 public:
  /// Reads and checks `path`; throws std::runtime_error with the reason (missing file,
  /// truncated header or data, overlapping or out-of-range offsets, shape and size that
  /// disagree, unknown dtype).
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  /// The tensor `name`; throws std::runtime_error when the file lacks it.
  const TensorView& at(const std::string& name) const;

 private:
  std::vector<uint8_t> bytes_;
  std::map<std::string, TensorView> tensors_;
};

/// Writes `tensors` (name -> view) as a safetensors file; throws on an I/O error.
void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors);

}  // namespace fedmoe

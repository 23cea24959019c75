// safetensors files and payloads, per the format's specification (huggingface/safetensors,
// README "Format") and PROTOCOL.md §6.5: an 8-byte little-endian header length N, N bytes of
// JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {str: str}},
// then the tensor data, each tensor's bytes at [begin, end) after the header, row-major,
// little-endian. Reading checks every rule of §6.5 against the bytes; nothing is trusted.
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

/// Bytes per element of a safetensors dtype of PROTOCOL.md §6.5 (F64, F32, F16, BF16, I64,
/// I32, I8, U8); throws std::runtime_error for any other.
size_t dtype_size(const std::string& dtype);

/// Elements of a shape (1 for a scalar).
uint64_t numel(const std::vector<int64_t>& shape);

/// A safetensors file or payload held in memory (anonymous memory: what a device's memory
/// budget counts, PROTOCOL.md §5.3a).
class SafetensorsFile {
 public:
  /// Reads and checks the file `path`.
  explicit SafetensorsFile(const std::string& path);
  /// Checks and keeps `bytes`; `what` names them in errors.
  SafetensorsFile(std::vector<uint8_t> bytes, const std::string& what);
  SafetensorsFile(SafetensorsFile&&) = default;
  SafetensorsFile& operator=(SafetensorsFile&&) = default;

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  /// The tensor `name`; throws std::runtime_error when the file lacks it.
  const TensorView& at(const std::string& name) const;
  /// Bytes held.
  size_t size() const { return bytes_.size(); }

 private:
  void parse(const std::string& what);
  std::vector<uint8_t> bytes_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

/// `tensors` (name -> view, in name order) and `metadata` as safetensors bytes, the header
/// padded with spaces to a multiple of 8.
std::vector<uint8_t> safetensors_bytes(const std::map<std::string, TensorView>& tensors,
                                       const std::map<std::string, std::string>& metadata = {});

/// Writes safetensors_bytes(tensors) to `path`, tensor by tensor (no copy of them held); throws on an I/O error.
void write_safetensors(const std::string& path, const std::map<std::string, TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

/// Reads a whole file; throws std::runtime_error when it cannot.
std::vector<uint8_t> read_file(const std::string& path);

}  // namespace fedmoe

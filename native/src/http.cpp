#include "http.hpp"

#include <curl/curl.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "crypto.hpp"

namespace fedmoe {

namespace {

constexpr uint64_t kWindow = 8ull << 20;  // FETCH_WINDOW_BYTES

struct Sink {
  std::FILE* f;
  Sha256* sha;
  uint64_t got = 0, limit = 0;
  bool over = false;
  bool take = false;  // the answer's status is one whose body is the file's bytes (200 first, 206)
};

size_t write_cb(char* data, size_t size, size_t n, void* user) {
  auto* s = static_cast<Sink*>(user);
  const size_t len = size * n;
  if (!s->take) return len;  // an error page: not the file's bytes
  if (s->got + len > s->limit) {  // a response longer than asked for
    s->over = true;
    return 0;
  }
  if (std::fwrite(data, 1, len, s->f) != len) return 0;
  s->sha->update(reinterpret_cast<const uint8_t*>(data), len);
  s->got += len;
  return len;
}

struct Header {
  Sink* sink = nullptr;
  bool first = false;  // the first request: a 200 with the whole file is accepted
  uint64_t whole = 0;
  std::string content_range;
};

size_t header_cb(char* data, size_t size, size_t n, void* user) {
  auto* h = static_cast<Header*>(user);
  const std::string line(data, size * n);
  std::string lower = line.substr(0, 14);
  for (auto& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (line.rfind("HTTP/", 0) == 0) {  // a status line (each response of a redirect has one): 200 may carry the file
    const auto sp = line.find(' ');
    const std::string code = sp == std::string::npos ? "" : line.substr(sp + 1, 3);
    h->sink->take = code == "206" || (code == "200" && h->first);
    if (code == "200" && h->first) h->sink->limit = h->whole;
    h->content_range.clear();
  } else if (line.size() > 14 && lower == "content-range:") {
    std::string v = line.substr(14);
    while (!v.empty() && v.front() == ' ') v.erase(v.begin());
    while (!v.empty() && (v.back() == '\r' || v.back() == '\n' || v.back() == ' ')) v.pop_back();
    h->content_range = v;
  }
  return size * n;
}

}  // namespace

FileCache::FileCache(std::string directory) : dir_(std::move(directory)) {
  std::filesystem::create_directories(dir_);
  static const bool init = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
  if (!init) throw std::runtime_error("libcurl failed to initialise");
}

std::string FileCache::fetch(const std::string& url, const std::string& sha256, uint64_t bytes, const std::string& suffix,
                             uint64_t max_bytes, double timeout_s) {
  const std::string path = dir_ + "/" + sha256 + suffix;
  if (std::filesystem::exists(path) && std::filesystem::file_size(path) == bytes) return path;  // verified when written
  if (bytes > max_bytes)
    throw std::runtime_error(url + ": " + std::to_string(bytes) + " bytes exceed this device's limit of " +
                             std::to_string(max_bytes));
  if (url.rfind("http://", 0) != 0 && url.rfind("https://", 0) != 0) throw std::runtime_error(url + ": not an http(s) URL");
  const std::string part = path + ".part";
  std::FILE* f = std::fopen(part.c_str(), "wb");
  if (!f) throw std::runtime_error(part + ": cannot write");
  Sha256 sha;
  Sink sink{f, &sha, 0, bytes};
  CURL* c = curl_easy_init();
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::string error;
  int retries = 0;
  while (error.empty() && (sink.got < bytes || (bytes == 0 && retries == 0))) {
    const uint64_t a = sink.got, b = std::min(bytes, a + kWindow) - (bytes ? 1 : 0);
    const double left = std::chrono::duration<double>(end - std::chrono::steady_clock::now()).count();
    if (left <= 0) {
      error = "timed out";
      break;
    }
    const std::string range = std::to_string(a) + "-" + std::to_string(b);
    sink.limit = bytes ? b + 1 : 0;
    Header h{&sink, a == 0, bytes, ""};
    curl_easy_reset(c);
    curl_easy_setopt(c, CURLOPT_URL, url.c_str());
    if (bytes) curl_easy_setopt(c, CURLOPT_RANGE, range.c_str());
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, write_cb);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, header_cb);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, &h);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, static_cast<long>(left * 1000));
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    const uint64_t before = sink.got;
    const CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    if (sink.got > before) retries = 0;  // progress: a cut-short answer is resumed from the next byte
    else if (rc == CURLE_OK && (status == 200 || status == 206) && ++retries > 3) error = "no progress";
    if (sink.over) {
      error = "the server sent more than asked for";
    } else if (status == 206 && h.content_range != "bytes " + range + "/" + std::to_string(bytes) &&
               h.content_range != "bytes " + range + "/*") {
      error = "Content-Range " + h.content_range + " is not the window asked for";
    } else if (status != 206 && !(status == 200 && a == 0) && rc == CURLE_OK) {
      error = "HTTP status " + std::to_string(status);
    } else if (rc != CURLE_OK && ++retries > 3) {
      error = std::string("transfer failed: ") + curl_easy_strerror(rc);
    }
    if (bytes == 0) break;
  }
  curl_easy_cleanup(c);
  std::fclose(f);
  const std::string got_sha = sha.hex();
  if (error.empty() && (sink.got != bytes || got_sha != sha256))
    error = "failed its sha256 check (" + std::to_string(sink.got) + " bytes) and was refused";
  if (!error.empty()) {
    std::filesystem::remove(part);
    throw std::runtime_error(url + ": " + error);
  }
  std::filesystem::rename(part, path);
  downloaded_ += sink.got;
  return path;
}

}  // namespace fedmoe

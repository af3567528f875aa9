// Message text built without iostreams: text("rank ", 3, " on ", device) -> "rank 3 on cpu".
//
// Why not c10's str() or a string stream: an extension compiled by a newer GCC than the libstdc++ it runs against
// (a toolchain in /opt next to the system's library, as on some CUDA images) can carry its own copy of ostream's
// number formatting, which then reads the other library's locale state and crashes: a user error becomes a
// segmentation fault. Strings pass through iostreams safely, numbers do not. So every number, dtype and device in
// a fastpar message is turned into characters here (std::to_chars, snprintf), and TORCH_CHECK receives one
// std::string, which c10::str hands on untouched.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <string>
#include <type_traits>

namespace fastpar {
namespace text_detail {

inline void put(std::string& out, const char* s) { out += s; }
inline void put(std::string& out, const std::string& s) { out += s; }
inline void put(std::string& out, char c) { out += c; }
inline void put(std::string& out, bool b) { out += b ? "true" : "false"; }
inline void put(std::string& out, at::ScalarType type) { out += c10::toString(type); }
inline void put(std::string& out, const at::Device& device) { out += device.str(); }

template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> && !std::is_same_v<T, char>,
                                       int> = 0>
void put(std::string& out, T value) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof(digits), value).ptr;
  out.append(digits, end);
}

// "%g": what an ostream prints for a double at its default precision (1.5, 30, 0.001).
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void put(std::string& out, T value) {
  char digits[32];
  const int n = std::snprintf(digits, sizeof(digits), "%g", static_cast<double>(value));
  out.append(digits, static_cast<size_t>(std::clamp(n, 0, static_cast<int>(sizeof(digits)) - 1)));
}

}  // namespace text_detail

template <typename... Parts>
std::string text(const Parts&... parts) {
  std::string out;
  (text_detail::put(out, parts), ...);
  return out;
}

}  // namespace fastpar

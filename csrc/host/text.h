// Error messages of the C++ host layer, built without iostreams.
#pragma once

#include <string>
#include <type_traits>

namespace compiled_moe {

// A message from pieces (strings and integers), without iostreams: on the H200 image (torch
// 2.11, g++ 13) formatting an integer through an ostream in this extension crashed the
// process (std::ostream::_M_insert<long>, reached from c10::str), so the layer's error
// messages are built here and handed to TORCH_CHECK or Python as one string.
inline void append(std::string& s, const std::string& piece) { s += piece; }
inline void append(std::string& s, const char* piece) { s += piece; }
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void append(std::string& s, T piece) { s += std::to_string(piece); }
template <typename... Pieces>
std::string cat(const Pieces&... pieces) {
  std::string s;
  (append(s, pieces), ...);
  return s;
}

}  // namespace compiled_moe

#pragma once

#include <cstdlib>
#include <optional>

// The FLASH_ATTN_* environment settings that tests, benchmarks and A/B runs use to force a path.
// Unset or empty means no preference; each caller decides whether to read once or at every call.
namespace flash {

inline const char* env_setting(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' ? v : nullptr;
}

// An on/off setting: "0" is off, any other value on.
inline std::optional<bool> env_switch(const char* name) {
  const char* v = env_setting(name);
  if (v == nullptr) return std::nullopt;
  return !(v[0] == '0' && v[1] == '\0');
}

inline std::optional<int> env_int(const char* name) {
  const char* v = env_setting(name);
  if (v == nullptr) return std::nullopt;
  return std::atoi(v);
}

}  // namespace flash

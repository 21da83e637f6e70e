// Turning runtime flags into compile-time ones, so each combination gets its own branch-free
// kernel: dispatch_bool(flag, f) calls f(std::true_type{}) or f(std::false_type{}).
#pragma once

#include <type_traits>

namespace fastllm {

template <typename F>
void dispatch_bool(bool flag, F&& f) {
  flag ? f(std::true_type{}) : f(std::false_type{});
}

}  // namespace fastllm

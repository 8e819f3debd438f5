// e^x for x ≤ 0, shared by the kernels of ops/csrc (each includes it; the build's cache key hashes it too).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

// e^x for x ≤ 0 in plain arithmetic the compiler vectorises (no libm call in the loop): x = n ln 2 + r with n an
// integer and |r| ≤ ln 2 / 2, r formed with ln 2 split in two (Cody & Waite) so that it stays exact for large |x|;
// e^x = 2^n · e^r, e^r by its degree-7 Taylor polynomial (truncation below 1e-8). Below −87.3 the result would be
// subnormal: clamped there (≈ 1.2e-38; elu(x) + 1 itself rounds to 0 long before, near x = −17).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);
  const float n = __builtin_rintf(x * 1.44269504088896341f);  // to nearest (vroundps)
  float r = __builtin_fmaf(n, -0.693145751953125f, x);        // ln 2's high part: n·hi is exact
  r = __builtin_fmaf(n, -1.42860676533018708e-6f, r);          // and its low part
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// src/core/geometry.h: the kernels' PackGQA row divider (multiply and shift) against integer division, for every
// group size up to 512 over the rows a kernel can see ([0, 2^31)): exhaustively below 2^17, at the top of the range
// and on random rows. Host arithmetic; the device form takes the same high 32 bits with __umulhi.
#include <cstdint>
#include <random>

#include <gtest/gtest.h>

#include "core/geometry.h"

namespace {

using sparse_prefill::geometry::RowDivider;

void expect_exact(const RowDivider& d, int32_t g, int32_t row) {
  ASSERT_EQ(d.position(row), row / g) << "g " << g << " row " << row;
  ASSERT_EQ(d.head(row), row % g) << "g " << g << " row " << row;
}

TEST(Geometry, RowDividerIsExactOnEveryKernelRow) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any_row(0, INT32_MAX);
  for (int32_t g = 1; g <= 512; ++g) {
    const RowDivider d(g);
    for (int32_t row = 0; row < (1 << 17); ++row) expect_exact(d, g, row);
    for (int32_t k = 0; k < 4096; ++k) expect_exact(d, g, INT32_MAX - k);
    for (int32_t k = 0; k < 20000; ++k) expect_exact(d, g, any_row(rng));
    for (int32_t q = 1; q < 64; ++q) {  // the multiples of g and their neighbours near the top of the range
      const int64_t row = int64_t(INT32_MAX / g - q) * g;
      for (int64_t r = row - 1; r <= row + 1; ++r) expect_exact(d, g, int32_t(r));
    }
  }
}

TEST(Geometry, RowDividerLargeGroups) {  // divisors far beyond any head count still divide exactly
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> any_row(0, INT32_MAX), any_g(513, INT32_MAX);
  for (int k = 0; k < 2000; ++k) {
    const int32_t g = any_g(rng);
    const RowDivider d(g);
    for (int j = 0; j < 200; ++j) expect_exact(d, g, any_row(rng));
    expect_exact(d, g, g - 1);
    expect_exact(d, g, g);
    expect_exact(d, g, INT32_MAX);
  }
}

}  // namespace

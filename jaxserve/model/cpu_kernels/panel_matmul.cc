// y = x . W on CPUs for float32 weights packed in column panels: an XLA FFI custom call that
// the CPU backend's `Linear` layers multiply through (see jaxserve/model/cpu_kernels/__init__.py
// for the build and the contract).
//
// W [K, N] is stored as panels [P, K, 32] (P = ceil(N / 32), the last one zero-padded): panel
// p holds output columns [32p, 32p + 32) row after row, so one panel is one contiguous read.
// Work item: a run of panels; each streams its panel once per block of up to 8 rows of x,
// with the block's 8 x 32 outputs in registers (16 vectors of 16 lanes on AVX-512; blocks of
// 2 rows on AVX2). A decode step has 1 row and a speculative verification 1 + K: their cost is
// reading W once, which XLA CPU's dot does at ~17 GB/s for one row and slower as rows are
// added (it packs W first); panels read at the memory's pace for any row count up to 8
// (benchmarks/RESULTS.md, #32). From 64 rows (prefill chunks) the blocks are the arithmetic's:
// 6 rows x 64 columns over pairs of panels on AVX-512 (within a few percent of XLA's dot),
// 6 rows x 16 columns on AVX2.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::ParallelFor;

namespace {

constexpr int64_t kPanel = 32;  // output columns per panel
// Panel rows fetched ahead (4 KB): with 5-8 rows of FMAs per weight row the hardware
// prefetcher alone falls behind (8 rows of SmolLM2's projections: 29.5 -> 23.6 ms).
constexpr int64_t kPrefetchRows = 32;

// Register blocks: a block's rows x 32 columns of accumulators, the panel row's vectors and a
// broadcast must fit the vector registers: 8 rows (16 zmm) with AVX-512's 32; 2 rows (8 ymm)
// with AVX2's 16 (8 rows there spill and run 5x slower; the 6 x 16 blocks of many rows below
// read one row 1.3x slower: an AVX2 build timed on an AVX-512 host).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 8;
#else
constexpr int kLanes = 8;
constexpr int kRows = 2;
#endif
constexpr int kVecs = kPanel / kLanes;
typedef float V __attribute__((vector_size(4 * kLanes)));

inline V LoadV(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreV(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// Rows [m0, m0 + MR) of x times NP adjacent panels (their columns [c, c + NV * kLanes) each)
// -> y [M, ldy] at the same columns from n0. kPrefetch: fetch the panel kPrefetchRows ahead
// (the first block of rows to read a panel, from memory; NP == 1, c == 0).
template <int MR, int NP = 1, int NV = kVecs, bool kPrefetch = true>
inline void Block(const float* x, const float* panel, float* y, int64_t K, int64_t ldy,
                  int64_t m0, int64_t n0, int64_t c = 0) {
  V acc[MR][NP * NV];
  const float* xr[MR];
  for (int r = 0; r < MR; ++r) {
    for (int v = 0; v < NP * NV; ++v) acc[r][v] = V{};
    xr[r] = x + (m0 + r) * K;
  }
  const int64_t stride = K * kPanel;  // from one panel to the next
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (kPrefetch) {
      const float* ahead = panel + std::min(k + kPrefetchRows, K - 1) * kPanel;
      __builtin_prefetch(ahead);
      __builtin_prefetch(ahead + 16);
    }
    V w[NP * NV];
    for (int j = 0; j < NP; ++j) {
      const float* row = panel + j * stride + k * kPanel + c;
      for (int v = 0; v < NV; ++v) w[j * NV + v] = LoadV(row + v * kLanes);
    }
    for (int r = 0; r < MR; ++r) {
      const V xv = V{} + xr[r][k];
      for (int v = 0; v < NP * NV; ++v) acc[r][v] += xv * w[v];
    }
  }
  for (int r = 0; r < MR; ++r) {
    float* out = y + (m0 + r) * ldy + n0 + c;
    for (int j = 0; j < NP; ++j) {
      for (int v = 0; v < NV; ++v) StoreV(out + j * kPanel + v * kLanes, acc[r][j * NV + v]);
    }
  }
}

constexpr int64_t kManyMinRows = 64;  // from this many rows, the blocks of many rows below
constexpr int kManyRows = 6;          // rows per block of many rows
// Many rows (prefill chunks) take blocks shaped for the arithmetic, not the weight read. On
// AVX-512: two adjacent panels at once, 6 rows x 64 columns (24 zmm accumulators), 10 loads per
// 24 FMAs where 8 x 32 take 10 per 16 (SmolLM2's projections at 1,024 rows 916 -> 839 ms;
// XLA's dot: 839). On AVX2: 6 rows x 16 columns (12 ymm, BLIS's Haswell block), each half of a
// panel in turn, 8 loads per 12 FMAs where 2 x 32 take 6 per 8.
#if defined(__AVX512F__)
constexpr int kManyPanels = 2, kManyVecs = kVecs;
#else
constexpr int kManyPanels = 1, kManyVecs = 2;
#endif
constexpr int64_t kManyCols = kManyVecs * kLanes;  // columns of a panel per block

// The last M % kRows rows: one block of R = rem rows (R < kRows).
template <int R>
inline void Tail(const float* x, const float* panel, float* y, int64_t K, int64_t ldy,
                 int64_t m0, int64_t rem, int64_t n0) {
  if constexpr (R >= 1) {
    if (rem == R) return Block<R>(x, panel, y, K, ldy, m0, n0);
    Tail<R - 1>(x, panel, y, K, ldy, m0, rem, n0);
  }
}

// Rows [m0, M) of x times one panel -> y's columns n0 ... n0 + 32.
void Rows(const float* x, const float* panel, float* y, int64_t K, int64_t ldy, int64_t m0,
          int64_t M, int64_t n0) {
  int64_t m = m0;
  // the first block reads the panel from memory, the others from the cache: no prefetch
  if (M - m >= kRows) Block<kRows>(x, panel, y, K, ldy, m, n0), m += kRows;
  for (; m + kRows <= M; m += kRows) Block<kRows, 1, kVecs, false>(x, panel, y, K, ldy, m, n0);
  Tail<kRows - 1>(x, panel, y, K, ldy, m, M - m, n0);
}

// Every row of x times panels [p, end) of w.
void Panels(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t ldy,
            int64_t p, int64_t end) {
  if (M >= kManyMinRows) {
    const int64_t body = M / kManyRows * kManyRows;
    for (; p + kManyPanels <= end; p += kManyPanels) {
      const float* panel = w + p * K * kPanel;
      for (int64_t c = 0; c < kPanel; c += kManyCols) {
        for (int64_t m = 0; m < body; m += kManyRows) {
          Block<kManyRows, kManyPanels, kManyVecs, false>(x, panel, y, K, ldy, m, p * kPanel,
                                                          c);
        }
      }
      for (int64_t q = p; q < p + kManyPanels; ++q) {  // the last M % kManyRows rows
        Rows(x, w + q * K * kPanel, y, K, ldy, body, M, q * kPanel);
      }
    }
  }
  for (; p < end; ++p) Rows(x, w + p * K * kPanel, y, K, ldy, 0, M, p * kPanel);
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[2] != kPanel || wd[1] != xd[1] ||
      yd[0] != xd[0] || yd[1] != wd[0] * kPanel) {
    return ffi::Error::InvalidArgument(
        "panel_matmul: expected x [M, K], w [P, K, 32] and y [M, 32 P]");
  }
  const int64_t M = xd[0], K = xd[1], P = wd[0], ldy = yd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (M == 0 || P == 0) return ffi::Error::Success();
  if (K == 0) {
    std::memset(yp, 0, sizeof(float) * M * ldy);
    return ffi::Error::Success();
  }
  // ~16 items: enough to balance a few threads, few enough that each is a long read (with
  // many rows, an even number of panels each, for the pairs)
  int64_t per_item = std::max<int64_t>(1, P / 16);
  if (M >= kManyMinRows && per_item % 2) ++per_item;
  const int64_t items = (P + per_item - 1) / per_item;
  ParallelFor(&pool, items, [&](int64_t i) {
    Panels(xp, wp, yp, M, K, ldy, i * per_item, std::min(P, (i + 1) * per_item));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePanelMatmulCpu, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [P, K, 32]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y [M, 32 P]

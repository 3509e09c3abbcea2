// Paged attention on CPUs: an XLA FFI custom call that reads each sequence's keys and values
// where they lie in the paged cache, block by block, instead of gathering a copy of them first
// (what the jnp path must do; see jaxserve/model/cpu_kernels/__init__.py for the build and
// the contract).
//
// Rows of short queries (decode rows, speculative verification rows): work item (sequence,
// key split). A sequence's keys are cut into splits of at most `split_keys` keys so that one
// long context keeps every thread busy; each item walks its keys block by block (every KV head
// of a block at once: one contiguous read, the next block prefetched) with an online softmax
// for all of the sequence's query rows, and the items of one sequence are merged at the end
// (flash-decoding's split-K).
//
// Prefill chunks (more than max_q_len query tokens; when `prefill` is set and D is one of
// kPrefillDims): work item (sequence, query tile, KV head), a flash-attention tile on CPU
// registers. The tile's query rows (its tokens x the head's G query heads, ~128) are held
// transposed, rows in the vector lanes, and walk the sequence's keys in panels of 32: scores
// from a register-blocked product (4 keys x 64 rows per block, D reduced in registers), an
// online softmax that is elementwise over 16 rows at a time (no horizontal reductions), and
// P . V accumulated into the rows' outputs in registers. Masks are built only for the panels
// that cross the causal diagonal, the window's edge or a block outside the cache.
//
// Items of both kinds are handed out through an atomic counter to the caller and XLA's
// intra-op threads, the longest prefill tiles first.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <vector>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using jaxserve::ParallelFor;

namespace {

inline float Load(const uint16_t* p, int64_t i) {  // bfloat16 -> float32 (exact)
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Problem {
  const float* q;           // [T, Hkv, G, D]
  const int32_t* tables;    // [S, P]
  const int32_t* ctx;       // [S]
  const int32_t* qsl;       // [S + 1]
  float* out;               // [T, Hkv, G, D]
  int64_t T, Hkv, G, D, S, P, block_size, num_blocks;
  int64_t num_seqs, min_q, max_q, split_keys, window;  // window 0: none
  bool prefill;                                        // attend q_len > max_q too
  float scale, soft_cap;                               // soft_cap 0: none
};

struct Item {
  int64_t seq, key_begin, key_end, slot;  // slot: first row of its partials
};

constexpr float kNeg = -1e30f;  // the running max before any key (finite: -ffast-math)

// A block's keys or values [n, Hkv, D] as float32: in place for a float32 cache, widened into
// `buf` otherwise.
inline const float* Widen(const float* block, int64_t, float*) { return block; }

template <typename T>
const float* Widen(const T* block, int64_t size, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) buf[i] = Load(block, i);
  return buf;
}

template <typename T>
void Prefetch(const T* p, int64_t size) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < size * static_cast<int64_t>(sizeof(T)); i += 64)
    __builtin_prefetch(c + i);
}

// One item: the online softmax of its sequence's query rows [q_len, Hkv, G] over the keys
// [key_begin, key_end), into m, l [rows] and acc [rows, D].
template <typename T>
void RunItem(const Problem& pb, const T* kc, const T* vc, const Item& it, float* m, float* l,
             float* acc) {
  const int64_t q0 = pb.qsl[it.seq], q_len = pb.qsl[it.seq + 1] - q0;
  const int64_t G = pb.G, Hkv = pb.Hkv, D = pb.D, bs = pb.block_size;
  const int64_t rows = q_len * Hkv * G, stride = Hkv * D;  // stride: between keys
  const int64_t first_pos = pb.ctx[it.seq] - q_len;  // position of the first query token
  const float* q = pb.q + q0 * Hkv * G * D;          // [q_len, Hkv, G, D], contiguous
  std::vector<float> s(bs), p(bs), kbuf(bs * stride), vbuf(bs * stride);
  std::fill(m, m + rows, kNeg);
  std::fill(l, l + rows, 0.f);
  std::fill(acc, acc + rows * D, 0.f);
  const int32_t* table = pb.tables + it.seq * pb.P;
  for (int64_t b0 = it.key_begin; b0 < it.key_end; b0 = (b0 / bs + 1) * bs) {
    const int64_t b1 = std::min((b0 / bs + 1) * bs, it.key_end), n = b1 - b0;
    const int64_t page = table[b0 / bs];
    if (page < 0 || page >= pb.num_blocks) continue;  // not a block of this cache: skipped
    const int64_t at = (page * bs + b0 % bs) * stride;
    if (b1 < it.key_end) {  // the next block's keys and values, while this one computes
      const int64_t next = std::clamp<int64_t>(table[b1 / bs], 0, pb.num_blocks - 1) * bs * stride;
      const int64_t len = std::min(bs, it.key_end - b1) * stride;
      Prefetch(kc + next, len);
      Prefetch(vc + next, len);
    }
    const float* kb = Widen(kc + at, n * stride, kbuf.data());
    const float* vb = Widen(vc + at, n * stride, vbuf.data());
    for (int64_t t = 0; t < q_len; ++t) {
      const int64_t pos = first_pos + t;
      int64_t lo = 0, hi = std::min(n, pos + 1 - b0);  // keys [lo, hi) of this block
      if (pb.window > 0) lo = std::max<int64_t>(0, pos - pb.window + 1 - b0);
      if (lo >= hi) continue;
      for (int64_t h = 0; h < Hkv; ++h) {
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = (t * Hkv + h) * G + g;
          const float* qr = q + r * D;
          float mx = m[r];
          for (int64_t j = lo; j < hi; ++j) {
            const float* kj = kb + j * stride + h * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qr[d] * kj[d];
            s[j] = dot * pb.scale;
          }
          if (pb.soft_cap > 0.f) {
            const float cap = pb.soft_cap, inv = 1.f / pb.soft_cap;
#pragma omp simd
            for (int64_t j = lo; j < hi; ++j) s[j] = cap * std::tanh(s[j] * inv);
          }
          for (int64_t j = lo; j < hi; ++j) mx = std::max(mx, s[j]);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = lo; j < hi; ++j) {
            p[j] = std::exp(s[j] - mx);
            sum += p[j];
          }
          const float corr = std::exp(m[r] - mx);  // 0 before the first key
          float* ar = acc + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          for (int64_t j = lo; j < hi; ++j) {
            const float* vj = vb + j * stride + h * D;
            const float pj = p[j];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] += pj * vj[d];
          }
          l[r] = l[r] * corr + sum;
          m[r] = mx;
        }
      }
    }
  }
}

// ---- Prefill tiles -------------------------------------------------------------------------

typedef float V16 __attribute__((vector_size(64)));  // 16 floats: one AVX-512 register
typedef int32_t I16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kRowVecs = 4;  // query-row vectors per register block (64 rows)
constexpr int kCols = 4;     // keys (scores) or value columns (P . V) per register block
#else  // 16 vector registers (AVX2, NEON): a V16 takes 2-4 of them
constexpr int kRowVecs = 1;
constexpr int kCols = 4;
#endif
constexpr int kPanel = 32;  // keys per panel

inline V16 LoadV(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void StoreV(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }
inline V16 Splat(float x) { return V16{} + x; }
// exp(x) for x <= 88 in float32 (relative error ~2e-7; below -87 it returns ~1e-38, not 0):
// 2^k * 2^f with k = round(x log2 e) and a degree-6 polynomial for 2^f, f in [-1/2, 1/2]
// (Cephes' exp2f coefficients).
inline V16 Exp(V16 x) {
  x = x < -87.f ? Splat(-87.f) : x;
  const V16 t = x * 1.44269504088896341f;
  // round to nearest, away from zero (conversion truncates; -ffast-math would fold the
  // usual add-and-subtract-2^23 trick away)
  const I16 ki = __builtin_convertvector(t + (t < 0.f ? Splat(-0.5f) : Splat(0.5f)), I16);
  const V16 f = t - __builtin_convertvector(ki, V16);
  V16 p = Splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const I16 bits = (ki + 127) << 23;
  V16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

inline V16 SoftCap(V16 s, float cap) {  // cap * tanh(s / cap) = cap * (1 - 2 / (e^(2s/cap) + 1))
  V16 y = s * (2.f / cap);
  y = y > 80.f ? Splat(80.f) : y;
  y = y < -80.f ? Splat(-80.f) : y;
  const V16 e = Exp(y) + 1.f;  // Exp handles positive arguments up to 80 too
  return (1.f - 2.f / e) * cap;
}

// The tile works transposed, rows in the vectors' lanes: queries qt [D, Mp], scores and
// weights st [kPanel, Mp], outputs ot [D, Mp] (Mp: rows rounded up to 16), so that the online
// softmax over a panel's keys is elementwise over 16 rows at a time (no horizontal reductions).

// st[j0 + c, rows] = kp[j0 + c, :] . qt[:, rows] for NJ keys and RV row vectors.
template <int D, int RV, int NJ>
inline void ScoreBlock(const float* qt, int64_t mp, const float* kp, float* st) {
  V16 a[NJ][RV];
  for (int c = 0; c < NJ; ++c)
    for (int i = 0; i < RV; ++i) a[c][i] = V16{};
  for (int d = 0; d < D; ++d) {
    V16 x[RV];
    for (int i = 0; i < RV; ++i) x[i] = LoadV(qt + d * mp + i * 16);
    for (int c = 0; c < NJ; ++c) {
      const V16 k = Splat(kp[c * D + d]);
      for (int i = 0; i < RV; ++i) a[c][i] += k * x[i];
    }
  }
  for (int c = 0; c < NJ; ++c)
    for (int i = 0; i < RV; ++i) StoreV(st + c * mp + i * 16, a[c][i]);
}

// ot[d0 + c, rows] = ot[d0 + c, rows] * corr[rows] + sum_j vp[j, d0 + c] st[j, rows] for ND
// value columns and RV row vectors.
template <int D, int RV, int ND>
inline void ValueBlock(const float* st, int64_t mp, const float* vp, int n, const float* corr,
                       float* ot) {
  V16 a[ND][RV], cr[RV];
  for (int i = 0; i < RV; ++i) cr[i] = LoadV(corr + i * 16);
  for (int c = 0; c < ND; ++c)
    for (int i = 0; i < RV; ++i) a[c][i] = LoadV(ot + c * mp + i * 16) * cr[i];
  for (int j = 0; j < n; ++j) {
    V16 p[RV];
    for (int i = 0; i < RV; ++i) p[i] = LoadV(st + j * mp + i * 16);
    for (int c = 0; c < ND; ++c) {
      const V16 v = Splat(vp[j * D + c]);
      for (int i = 0; i < RV; ++i) a[c][i] += v * p[i];
    }
  }
  for (int c = 0; c < ND; ++c)
    for (int i = 0; i < RV; ++i) StoreV(ot + c * mp + i * 16, a[c][i]);
}

template <int D>
void ScorePanel(const float* qt, int64_t mp, const float* kp, float* st) {
  for (int j = 0; j < kPanel; j += kCols) {
    int64_t r = 0;
    for (; r + 16 * kRowVecs <= mp; r += 16 * kRowVecs)
      ScoreBlock<D, kRowVecs, kCols>(qt + r, mp, kp + j * D, st + j * mp + r);
    for (; r < mp; r += 16) ScoreBlock<D, 1, kCols>(qt + r, mp, kp + j * D, st + j * mp + r);
  }
}

template <int D>
void ValuePanel(const float* st, int64_t mp, const float* vp, int n, const float* corr,
                float* ot) {
  static_assert(D % kCols == 0, "value columns come in blocks of kCols");
  for (int c = 0; c < D; c += kCols) {
    int64_t r = 0;
    for (; r + 16 * kRowVecs <= mp; r += 16 * kRowVecs)
      ValueBlock<D, kRowVecs, kCols>(st + r, mp, vp + c, n, corr + r, ot + c * mp + r);
    for (; r < mp; r += 16)
      ValueBlock<D, 1, kCols>(st + r, mp, vp + c, n, corr + r, ot + c * mp + r);
  }
}

struct Tile {
  int64_t seq, t0, nt, head, keys;  // query tokens [t0, t0 + nt) of seq; keys: its work
};

inline void CopyRow(const float* src, float* dst, int64_t D) { std::memcpy(dst, src, D * 4); }
inline void CopyRow(const uint16_t* src, float* dst, int64_t D) {
  for (int64_t d = 0; d < D; ++d) dst[d] = Load(src, d);
}

struct PrefillScratch {
  std::vector<float> qt, ot, st, kp, vp, m, l, corr, pos;
};

// One tile: its query rows (nt tokens x G heads of KV head `head`; row r = token r / G) over
// the sequence's keys, panel by panel.
template <int D, typename T>
void RunTile(const Problem& pb, const T* kc, const T* vc, const Tile& tl) {
  static thread_local PrefillScratch sc;
  const int64_t G = pb.G, Hkv = pb.Hkv, bs = pb.block_size, stride = Hkv * D;
  const int64_t q0 = pb.qsl[tl.seq], q_len = pb.qsl[tl.seq + 1] - q0;
  const int64_t rows = tl.nt * G, mp = (rows + 15) / 16 * 16;
  const int64_t pos0 = pb.ctx[tl.seq] - q_len + tl.t0;  // position of the tile's first token
  const int64_t pos1 = pos0 + tl.nt - 1;
  sc.qt.assign(D * mp, 0.f), sc.ot.assign(D * mp, 0.f), sc.st.resize(kPanel * mp);
  sc.kp.resize(kPanel * D), sc.vp.resize(kPanel * D);
  sc.m.assign(mp, kNeg), sc.l.assign(mp, 0.f), sc.corr.resize(mp), sc.pos.resize(mp);
  float *qt = sc.qt.data(), *ot = sc.ot.data(), *st = sc.st.data(), *kp = sc.kp.data();
  float *vp = sc.vp.data(), *m = sc.m.data(), *l = sc.l.data(), *corr = sc.corr.data();
  for (int64_t r = 0; r < mp; ++r) sc.pos[r] = static_cast<float>(pos0 + std::min(r, rows - 1) / G);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = pb.q + (((q0 + tl.t0 + r / G) * Hkv + tl.head) * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) qt[d * mp + r] = src[d] * pb.scale;
  }
  int64_t k_begin = 0;
  if (pb.window > 0) k_begin = std::max<int64_t>(0, pos0 - pb.window + 1);
  const int64_t k_end = std::min(pos1 + 1, pb.P * bs);  // within the block table's reach
  const int32_t* table = pb.tables + tl.seq * pb.P;
  const float window = static_cast<float>(pb.window);
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kPanel) {
    const int n = static_cast<int>(std::min<int64_t>(kPanel, k_end - k0));
    bool valid[kPanel], holes = n < kPanel;  // keys of blocks outside the cache are masked
    for (int j = 0; j < kPanel; ++j) {
      const int64_t key = k0 + j, page = j < n ? table[key / bs] : -1;
      valid[j] = page >= 0 && page < pb.num_blocks;
      if (!valid[j]) {
        holes = true;
        std::fill(kp + j * D, kp + (j + 1) * D, 0.f);
        std::fill(vp + j * D, vp + (j + 1) * D, 0.f);
        continue;
      }
      const int64_t at = (page * bs + key % bs) * stride + tl.head * D;
      CopyRow(kc + at, kp + j * D, D);
      CopyRow(vc + at, vp + j * D, D);
    }
    ScorePanel<D>(qt, mp, kp, st);
    // Masks only where the panel crosses the diagonal, the window's edge or a hole.
    const bool whole =
        !holes && k0 + kPanel - 1 <= pos0 && (pb.window <= 0 || k0 > pos1 - pb.window);
    for (int64_t r = 0; r < mp; r += 16) {
      const V16 pos = LoadV(sc.pos.data() + r), m_old = LoadV(m + r);
      V16 mx = m_old;
      for (int j = 0; j < kPanel; ++j) {
        float* sj = st + j * mp + r;
        V16 x = LoadV(sj);
        if (pb.soft_cap > 0.f) x = SoftCap(x, pb.soft_cap);
        if (!whole) {
          const float key = static_cast<float>(k0 + j);
          auto on = pos >= key;  // causal
          if (pb.window > 0) on &= pos - window < key;
          x = valid[j] ? (on ? x : Splat(kNeg)) : Splat(kNeg);  // a hole: masked whole
        }
        StoreV(sj, x);
        mx = mx > x ? mx : x;
      }
      const V16 c = Exp(m_old - mx);  // 0 (~1e-38) before the row's first key
      V16 sum = V16{};
      for (int j = 0; j < kPanel; ++j) {
        float* sj = st + j * mp + r;
        const V16 x = LoadV(sj);
        V16 p = Exp(x - mx);
        if (!whole) p = x > kNeg ? p : V16{};  // masked keys weigh exactly 0
        StoreV(sj, p);
        sum += p;
      }
      StoreV(l + r, LoadV(l + r) * c + sum);
      StoreV(m + r, mx);
      StoreV(corr + r, c);
    }
    ValuePanel<D>(st, mp, vp, n, corr, ot);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = pb.out + (((q0 + tl.t0 + r / G) * Hkv + tl.head) * G + r % G) * D;
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * mp + r] * inv;
  }
}

template <typename T>
void RunTileAnyD(const Problem& pb, const T* kc, const T* vc, const Tile& tl) {
  switch (pb.D) {
    case 16: return RunTile<16>(pb, kc, vc, tl);
    case 32: return RunTile<32>(pb, kc, vc, tl);
    case 64: return RunTile<64>(pb, kc, vc, tl);
    case 80: return RunTile<80>(pb, kc, vc, tl);
    case 96: return RunTile<96>(pb, kc, vc, tl);
    case 128: return RunTile<128>(pb, kc, vc, tl);
    case 256: return RunTile<256>(pb, kc, vc, tl);
  }
}
constexpr int64_t kPrefillDims[] = {16, 32, 64, 80, 96, 128, 256};

template <typename T>
void Attend(const Problem& pb, const T* kc, const T* vc, ffi::ThreadPool* pool) {
  const int64_t D = pb.D, heads = pb.Hkv * pb.G;
  std::memset(pb.out, 0, sizeof(float) * pb.T * heads * D);
  std::vector<Item> items;
  std::vector<Tile> tiles;
  std::vector<int64_t> first_item;  // per attended sequence: index of its first item
  int64_t rows = 0;                 // partial rows so far
  // Prefill tiles of ~128 query rows (tokens x G), at least 8 tokens.
  const int64_t tile_tokens = std::clamp<int64_t>(128 / pb.G, 8, 64);
  for (int64_t s = 0; s < std::min(pb.num_seqs, pb.S); ++s) {
    const int64_t q_len = pb.qsl[s + 1] - pb.qsl[s];
    if (q_len < pb.min_q || (q_len > pb.max_q && !pb.prefill)) continue;
    // the last query token's position (at most the block table's reach: no read outside it)
    const int64_t last = std::min<int64_t>(pb.ctx[s], pb.P * pb.block_size) - 1;
    if (last < 0 || pb.qsl[s] < 0 || pb.qsl[s] + q_len > pb.T) continue;
    if (q_len > pb.max_q) {
      const int64_t pos0 = pb.ctx[s] - q_len;
      for (int64_t t0 = 0; t0 < q_len; t0 += tile_tokens) {
        const int64_t nt = std::min(tile_tokens, q_len - t0), hi = pos0 + t0 + nt;
        const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos0 + t0 - pb.window + 1) : 0;
        for (int64_t h = 0; h < pb.Hkv; ++h) tiles.push_back({s, t0, nt, h, hi - lo});
      }
      continue;
    }
    int64_t begin = 0;
    if (pb.window > 0) begin = std::max<int64_t>(0, last - q_len + 1 - pb.window + 1);
    first_item.push_back(items.size());
    for (int64_t k = begin; k <= last; k += pb.split_keys) {
      items.push_back({s, k, std::min(k + pb.split_keys, last + 1), rows});
      rows += q_len * heads;
    }
  }
  first_item.push_back(items.size());
  // the longest tiles first, so that the last ones to finish are short
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.keys * a.nt > b.keys * b.nt; });
  std::vector<float> m(rows), l(rows), acc(rows * D);
  const int64_t n_tiles = tiles.size();
  ParallelFor(pool, n_tiles + items.size(), [&](int64_t i) {
    if (i < n_tiles) return RunTileAnyD(pb, kc, vc, tiles[i]);
    const Item& it = items[i - n_tiles];
    RunItem(pb, kc, vc, it, &m[it.slot], &l[it.slot], &acc[it.slot * D]);
  });
  // Merge each sequence's splits into its rows of `out`.
  for (size_t grp = 0; grp + 1 < first_item.size(); ++grp) {
    const int64_t i0 = first_item[grp], i1 = first_item[grp + 1];
    const int64_t seq = items[i0].seq, q0 = pb.qsl[seq];
    const int64_t n_rows = (pb.qsl[seq + 1] - q0) * heads;
    for (int64_t r = 0; r < n_rows; ++r) {
      float mx = kNeg;
      for (int64_t i = i0; i < i1; ++i) mx = std::max(mx, m[items[i].slot + r]);
      if (mx <= kNeg) continue;  // no visible key
      float* o = pb.out + (q0 * heads + r) * D;
      float sum = 0.f;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t at = items[i].slot + r;
        const float w = std::exp(m[at] - mx);
        sum += l[at] * w;
        for (int64_t d = 0; d < D; ++d) o[d] += acc[at * D + d] * w;
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_cache,
                              ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> block_tables,
                              ffi::Buffer<ffi::S32> context_lens,
                              ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> num_seqs, float sm_scale, float soft_cap,
                              int64_t sliding_window, int64_t min_q_len, int64_t max_q_len,
                              int64_t split_keys, bool prefill,
                              ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto td = block_tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q must be 4-D, caches 4-D, tables 2-D");
  if (k_cache.element_type() != v_cache.element_type() ||
      !std::equal(kd.begin(), kd.end(), v_cache.dimensions().begin(), v_cache.dimensions().end()))
    return ffi::Error::InvalidArgument("paged attention: k and v caches differ in dtype or shape");
  Problem pb{q.typed_data(),  block_tables.typed_data(), context_lens.typed_data(),
             query_start_loc.typed_data(), out->typed_data()};
  pb.T = qd[0], pb.Hkv = qd[1], pb.G = qd[2], pb.D = qd[3];
  pb.S = td[0], pb.P = td[1], pb.block_size = kd[1], pb.num_blocks = kd[0];
  if (kd[2] != pb.Hkv || kd[3] != pb.D)
    return ffi::Error::InvalidArgument("paged attention: cache [N, bs, Hkv, D] does not match q");
  pb.num_seqs = num_seqs.typed_data()[0];
  pb.min_q = min_q_len, pb.max_q = max_q_len;
  pb.split_keys = std::max<int64_t>(split_keys, 1);
  pb.window = sliding_window, pb.scale = sm_scale, pb.soft_cap = soft_cap;
  pb.prefill = prefill;
  if (prefill && std::find(std::begin(kPrefillDims), std::end(kPrefillDims), pb.D) ==
                     std::end(kPrefillDims))
    return ffi::Error::InvalidArgument("paged attention: prefill tiles need D in 16, 32, 64, "
                                       "80, 96, 128, 256");
  switch (k_cache.element_type()) {
    case ffi::F32:
      Attend(pb, static_cast<const float*>(k_cache.untyped_data()),
             static_cast<const float*>(v_cache.untyped_data()), &pool);
      break;
    case ffi::BF16:
      Attend(pb, static_cast<const uint16_t*>(k_cache.untyped_data()),
             static_cast<const uint16_t*>(v_cache.untyped_data()), &pool);
      break;
    default:
      return ffi::Error::InvalidArgument("paged attention: cache dtype must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxservePagedAttentionCpu, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [T, Hkv, G, D]
                                  .Arg<ffi::AnyBuffer>()         // k_cache [N, bs, Hkv, D]
                                  .Arg<ffi::AnyBuffer>()         // v_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block_tables [S, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs []
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("sliding_window")
                                  .Attr<int64_t>("min_q_len")
                                  .Attr<int64_t>("max_q_len")
                                  .Attr<int64_t>("split_keys")
                                  .Attr<bool>("prefill")
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, Hkv, G, D]

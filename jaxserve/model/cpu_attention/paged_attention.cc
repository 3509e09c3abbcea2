// Paged attention for the rows of short queries (decode rows, speculative verification rows)
// on CPUs: an XLA FFI custom call that reads each sequence's keys and values where they lie in
// the paged cache, block by block, instead of gathering a copy of them first (what the jnp
// path must do; see jaxserve/model/cpu_attention/__init__.py for the build and the contract).
//
// Work item: (sequence, key split). A sequence's keys are cut into splits of at most
// `split_keys` keys so that one long context keeps every thread busy; each item walks its
// keys block by block (every KV head of a block at once: one contiguous read, the next block
// prefetched) with an online softmax for all of the sequence's query rows, and the items of
// one sequence are merged at the end (flash-decoding's split-K).
// Items are handed out through an atomic counter to the caller and XLA's intra-op threads.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

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

// Runs `n` tasks on the caller and the intra-op pool; returns when all have finished.
template <typename F>
void ParallelFor(ffi::ThreadPool* pool, int64_t n, F&& f) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, &f] {
    int64_t i, finished = 0;
    while ((i = st->next.fetch_add(1)) < n) {
      f(i);
      ++finished;
    }
    if (finished && st->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->cv.notify_all();
    }
  };
  const int64_t helpers = pool ? std::min<int64_t>(pool->num_threads(), n - 1) : 0;
  // A helper that starts after the work is done finds nothing to do and touches only `st`;
  // `f` is referenced only while items remain, i.e. before this function returns.
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

template <typename T>
void Attend(const Problem& pb, const T* kc, const T* vc, ffi::ThreadPool* pool) {
  const int64_t D = pb.D, heads = pb.Hkv * pb.G;
  std::memset(pb.out, 0, sizeof(float) * pb.T * heads * D);
  std::vector<Item> items;
  std::vector<int64_t> first_item;  // per attended sequence: index of its first item
  int64_t rows = 0;                 // partial rows so far
  for (int64_t s = 0; s < std::min(pb.num_seqs, pb.S); ++s) {
    const int64_t q_len = pb.qsl[s + 1] - pb.qsl[s];
    if (q_len < pb.min_q || q_len > pb.max_q) continue;
    // the last query token's position (at most the block table's reach: no read outside it)
    const int64_t last = std::min<int64_t>(pb.ctx[s], pb.P * pb.block_size) - 1;
    if (last < 0 || pb.qsl[s] < 0 || pb.qsl[s] + q_len > pb.T) continue;
    int64_t begin = 0;
    if (pb.window > 0) begin = std::max<int64_t>(0, last - q_len + 1 - pb.window + 1);
    first_item.push_back(items.size());
    for (int64_t k = begin; k <= last; k += pb.split_keys) {
      items.push_back({s, k, std::min(k + pb.split_keys, last + 1), rows});
      rows += q_len * heads;
    }
  }
  first_item.push_back(items.size());
  std::vector<float> m(rows), l(rows), acc(rows * D);
  ParallelFor(pool, items.size(), [&](int64_t i) {
    const Item& it = items[i];
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
                              int64_t split_keys, ffi::ResultBuffer<ffi::F32> out) {
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
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [T, Hkv, G, D]

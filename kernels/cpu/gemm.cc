// GEMM, y = x * w^T (+ bias), batch-invariant: every y[i][j] is the fma chain
// over k in order 0..k-1 starting from +0, then + bias[j] — whatever m, the
// row's position, the tile, the thread count or the instruction set. Tiles
// only decide which chains run side by side (register blocking reuses each
// weight load for R rows and each x broadcast for P panels); k-blocking
// parks a chain's partial sum in y and resumes it, which changes no bits.
#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels/cpu/ops.h"

namespace tandem::kernels::cpu {

void PackedWeights::Free::operator()(float* p) const { std::free(p); }

// Packs of 2 MiB and more go on huge pages where the kernel has them
// (AllocateStreamed): a batch-1 decode streams every pack once per token, one
// TLB miss per 4 KiB page otherwise (issue 23,
// bench/results/cpu_vs_llamacpp/session-43.md).
void* AllocateStreamed(size_t bytes) {
  constexpr size_t kHugePage = size_t{2} << 20;
  if (bytes < kHugePage)
    return std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  void* p = nullptr;
  if (posix_memalign(&p, kHugePage, bytes) != 0) return nullptr;
  madvise(p, bytes & ~(size_t{4095}), MADV_HUGEPAGE);
  return p;
}

PackedWeights PackWeights(const float* w, int n, int k) {
  PackedWeights out;
  out.n_ = n;
  out.k_ = k;
  const size_t floats = static_cast<size_t>(out.panels()) * k * PackedWeights::kPanel;
  out.data_.reset(static_cast<float*>(AllocateStreamed(floats * sizeof(float))));
  float* dst = out.data_.get();
  for (int p = 0; p < out.panels(); ++p) {
    for (int kk = 0; kk < k; ++kk) {
      for (int c = 0; c < PackedWeights::kPanel; ++c) {
        const int col = p * PackedWeights::kPanel + c;
        *dst++ = col < n ? w[static_cast<size_t>(col) * k + kk] : 0.0f;
      }
    }
  }
  return out;
}

namespace {

constexpr int kP = PackedWeights::kPanel;
// k-block: one block of P panels (P * 16 * kKc floats, 32 KiB for P = 4)
// stays in L1 while every row block streams past it. With few rows there is
// nothing to reuse: stream each panel once, whole.
constexpr int kKc = 128;
constexpr int kFewRows = 4;
// With fewer than kFewRows rows every weight is read once, from memory:
// the AVX-512 tiles then ask for each panel's row kAheadRows ahead of the
// one they load (8 x 64 B = 512 B per panel stream), which the hardware
// prefetcher alone did not keep up with on one core (issue 23; measured in
// bench/results/cpu_vs_llamacpp/session-40.md). A hint only: no bit of
// any result depends on it.
constexpr int kAheadRows = 8;

struct GemmArgs {
  const float* x;       // [m][ldx], the chain reads x[i][0 .. k)
  const float* packed;  // panel p at packed + p * pstride: [k][16]
  const float* bias;    // [n] or nullptr
  float* y;             // [m][n]
  int m, n, k;
  int ldx;              // x row stride (k for a whole GEMM)
  size_t pstride;       // panel stride in floats (k * 16 for a whole GEMM)
};

// ---------------------------------------------------------------- portable
// Scalar fma chains in the same order as the vector paths.
void TilePortable(const GemmArgs& a, int i0, int rows, int p0, int panels, int k0, int k1) {
  for (int i = i0; i < i0 + rows; ++i) {
    const float* xr = a.x + static_cast<size_t>(i) * a.ldx;
    for (int p = p0; p < p0 + panels; ++p) {
      const float* wp = a.packed + static_cast<size_t>(p) * a.pstride;
      float* yr = a.y + static_cast<size_t>(i) * a.n;
      float acc[kP];
      for (int c = 0; c < kP; ++c) {
        const int col = p * kP + c;
        acc[c] = (k0 == 0 || col >= a.n) ? 0.0f : yr[col];
      }
      for (int kk = k0; kk < k1; ++kk) {
        for (int c = 0; c < kP; ++c) acc[c] = std::fma(xr[kk], wp[kk * kP + c], acc[c]);
      }
      const bool last = k1 == a.k;
      for (int c = 0; c < kP && p * kP + c < a.n; ++c) {
        const int col = p * kP + c;
        yr[col] = (last && a.bias != nullptr) ? acc[c] + a.bias[col] : acc[c];
      }
    }
  }
}

// ----------------------------------------------------------------- AVX-512
// Row kk of each of the P panels into L1 ahead of its load (kAheadRows).
template <int P>
inline void PrefetchRows(const float* const* wp, int kk) {
  for (int p = 0; p < P; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(wp[p] + static_cast<size_t>(kk) * kP), _MM_HINT_T0);
  }
}

template <int R, int P>
__attribute__((target("avx512f"))) void TileAvx512(const GemmArgs& a, int i0, int p0, int k0,
                                                   int k1) {
  __m512 acc[R][P];
  __mmask16 mask[P];
  for (int p = 0; p < P; ++p) {
    const int valid = std::min(kP, a.n - (p0 + p) * kP);
    mask[p] = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : ((1u << valid) - 1u));
  }
  for (int r = 0; r < R; ++r) {
    float* yr = a.y + static_cast<size_t>(i0 + r) * a.n;
    for (int p = 0; p < P; ++p) {
      acc[r][p] = k0 == 0 ? _mm512_setzero_ps()
                          : _mm512_maskz_loadu_ps(mask[p], yr + (p0 + p) * kP);
    }
  }
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = a.x + static_cast<size_t>(i0 + r) * a.ldx;
  const float* wp[P];
  for (int p = 0; p < P; ++p) wp[p] = a.packed + static_cast<size_t>(p0 + p) * a.pstride;
  // Streaming (few rows): ahead of the loads. Otherwise the k-block's
  // weights are in cache for the row blocks after the first.
  const bool streams = a.m < kFewRows;
  for (int kk = k0; kk < k1; ++kk) {
    __m512 w[P];
    if (streams && kk + kAheadRows < k1) PrefetchRows<P>(wp, kk + kAheadRows);
    for (int p = 0; p < P; ++p) w[p] = _mm512_load_ps(wp[p] + static_cast<size_t>(kk) * kP);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(xr[r][kk]);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xb, w[p], acc[r][p]);
    }
  }
  const bool add_bias = k1 == a.k && a.bias != nullptr;
  for (int p = 0; p < P; ++p) {
    const __m512 b =
        add_bias ? _mm512_maskz_loadu_ps(mask[p], a.bias + (p0 + p) * kP) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      float* yr = a.y + static_cast<size_t>(i0 + r) * a.n;
      const __m512 v = add_bias ? _mm512_add_ps(acc[r][p], b) : acc[r][p];
      _mm512_mask_storeu_ps(yr + (p0 + p) * kP, mask[p], v);
    }
  }
}

// ------------------------------------------------------------------- AVX2
// A 16-column panel is two 8-lane halves; lanes are independent, so the bits
// equal the AVX-512 path's.
template <int R, int P>
__attribute__((target("avx2,fma"))) void TileAvx2(const GemmArgs& a, int i0, int p0, int k0,
                                                  int k1) {
  __m256 acc[R][P][2];
  __m256i mask[P][2];
  for (int p = 0; p < P; ++p) {
    const int valid = std::min(kP, a.n - (p0 + p) * kP);
    for (int h = 0; h < 2; ++h) {
      alignas(32) int32_t m8[8];
      for (int l = 0; l < 8; ++l) m8[l] = (h * 8 + l) < valid ? -1 : 0;
      mask[p][h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(m8));
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = a.y + static_cast<size_t>(i0 + r) * a.n;
    for (int p = 0; p < P; ++p) {
      for (int h = 0; h < 2; ++h) {
        acc[r][p][h] = k0 == 0 ? _mm256_setzero_ps()
                               : _mm256_maskload_ps(yr + (p0 + p) * kP + h * 8, mask[p][h]);
      }
    }
  }
  const float* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = a.x + static_cast<size_t>(i0 + r) * a.ldx;
  const float* wp[P];
  for (int p = 0; p < P; ++p) wp[p] = a.packed + static_cast<size_t>(p0 + p) * a.pstride;
  for (int kk = k0; kk < k1; ++kk) {
    __m256 w[P][2];
    for (int p = 0; p < P; ++p) {
      w[p][0] = _mm256_load_ps(wp[p] + static_cast<size_t>(kk) * kP);
      w[p][1] = _mm256_load_ps(wp[p] + static_cast<size_t>(kk) * kP + 8);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr[r] + kk);
      for (int p = 0; p < P; ++p) {
        acc[r][p][0] = _mm256_fmadd_ps(xb, w[p][0], acc[r][p][0]);
        acc[r][p][1] = _mm256_fmadd_ps(xb, w[p][1], acc[r][p][1]);
      }
    }
  }
  const bool add_bias = k1 == a.k && a.bias != nullptr;
  for (int p = 0; p < P; ++p) {
    for (int h = 0; h < 2; ++h) {
      const __m256 b = add_bias ? _mm256_maskload_ps(a.bias + (p0 + p) * kP + h * 8, mask[p][h])
                                : _mm256_setzero_ps();
      for (int r = 0; r < R; ++r) {
        float* yr = a.y + static_cast<size_t>(i0 + r) * a.n;
        const __m256 v = add_bias ? _mm256_add_ps(acc[r][p][h], b) : acc[r][p][h];
        _mm256_maskstore_ps(yr + (p0 + p) * kP + h * 8, mask[p][h], v);
      }
    }
  }
}

// ------------------------------------------- split-K tiles (few rows)
// GemmSplitK with fewer than kFewRows rows (decode): one tile computes every
// shard's whole chain in turn and adds the partials in registers as the
// fixed tree — a binary counter: after shard s, partials of equal level
// merge (left = the earlier shards), so 4 shards give (p0 + p1) + (p2 + p3).
// Same bits as the shard-by-shard path (same chains, same adds).
constexpr int kMaxSplitLevels = 4;  // up to 8 shards

template <int R, int P>
__attribute__((target("avx512f"))) void TileAvx512Split(const GemmArgs* sa, int shards, int i0,
                                                        int p0) {
  const GemmArgs& a0 = sa[0];
  __mmask16 mask[P];
  for (int p = 0; p < P; ++p) {
    const int valid = std::min(kP, a0.n - (p0 + p) * kP);
    mask[p] = static_cast<__mmask16>(valid >= 16 ? 0xFFFF : ((1u << valid) - 1u));
  }
  // tree[l]: the pending partial of level l (2^l shards summed). After the
  // last shard (shards a power of two) acc holds the whole tree.
  __m512 tree[kMaxSplitLevels - 1][R][P] = {};
  __m512 acc[R][P] = {};
  for (int s = 0; s < shards; ++s) {
    const GemmArgs& a = sa[s];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
    }
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = a.x + static_cast<size_t>(i0 + r) * a.ldx;
    const float* wp[P];
    for (int p = 0; p < P; ++p) wp[p] = a.packed + static_cast<size_t>(p0 + p) * a.pstride;
    for (int kk = 0; kk < a.k; ++kk) {
      __m512 w[P];
      if (kk + kAheadRows < a.k) PrefetchRows<P>(wp, kk + kAheadRows);
      for (int p = 0; p < P; ++p) w[p] = _mm512_load_ps(wp[p] + static_cast<size_t>(kk) * kP);
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(xr[r][kk]);
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xb, w[p], acc[r][p]);
      }
    }
    int lvl = 0;
    for (; (s >> lvl) & 1; ++lvl) {
      for (int r = 0; r < R; ++r) {
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_add_ps(tree[lvl][r][p], acc[r][p]);
      }
    }
    if (s + 1 == shards) break;
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) tree[lvl][r][p] = acc[r][p];
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = a0.y + static_cast<size_t>(i0 + r) * a0.n;
    for (int p = 0; p < P; ++p) _mm512_mask_storeu_ps(yr + (p0 + p) * kP, mask[p], acc[r][p]);
  }
}

template <int R, int P>
__attribute__((target("avx2,fma"))) void TileAvx2Split(const GemmArgs* sa, int shards, int i0,
                                                      int p0) {
  const GemmArgs& a0 = sa[0];
  __m256i mask[P][2];
  for (int p = 0; p < P; ++p) {
    const int valid = std::min(kP, a0.n - (p0 + p) * kP);
    for (int h = 0; h < 2; ++h) {
      alignas(32) int32_t m8[8];
      for (int l = 0; l < 8; ++l) m8[l] = (h * 8 + l) < valid ? -1 : 0;
      mask[p][h] = _mm256_load_si256(reinterpret_cast<const __m256i*>(m8));
    }
  }
  __m256 tree[kMaxSplitLevels - 1][R][P][2] = {};
  __m256 acc[R][P][2] = {};
  for (int s = 0; s < shards; ++s) {
    const GemmArgs& a = sa[s];
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    }
    const float* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = a.x + static_cast<size_t>(i0 + r) * a.ldx;
    const float* wp[P];
    for (int p = 0; p < P; ++p) wp[p] = a.packed + static_cast<size_t>(p0 + p) * a.pstride;
    for (int kk = 0; kk < a.k; ++kk) {
      __m256 w[P][2];
      for (int p = 0; p < P; ++p) {
        w[p][0] = _mm256_load_ps(wp[p] + static_cast<size_t>(kk) * kP);
        w[p][1] = _mm256_load_ps(wp[p] + static_cast<size_t>(kk) * kP + 8);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xr[r] + kk);
        for (int p = 0; p < P; ++p) {
          acc[r][p][0] = _mm256_fmadd_ps(xb, w[p][0], acc[r][p][0]);
          acc[r][p][1] = _mm256_fmadd_ps(xb, w[p][1], acc[r][p][1]);
        }
      }
    }
    int lvl = 0;
    for (; (s >> lvl) & 1; ++lvl) {
      for (int r = 0; r < R; ++r) {
        for (int p = 0; p < P; ++p) {
          for (int h = 0; h < 2; ++h) acc[r][p][h] = _mm256_add_ps(tree[lvl][r][p][h], acc[r][p][h]);
        }
      }
    }
    if (s + 1 == shards) break;
    for (int r = 0; r < R; ++r) {
      for (int p = 0; p < P; ++p) {
        for (int h = 0; h < 2; ++h) tree[lvl][r][p][h] = acc[r][p][h];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float* yr = a0.y + static_cast<size_t>(i0 + r) * a0.n;
    for (int p = 0; p < P; ++p) {
      for (int h = 0; h < 2; ++h) {
        _mm256_maskstore_ps(yr + (p0 + p) * kP + h * 8, mask[p][h], acc[r][p][h]);
      }
    }
  }
}

// ------------------------------------------------------- tile dispatch
using TileFn = void (*)(const GemmArgs&, int i0, int p0, int k0, int k1);

constexpr int kMaxR = 8;
constexpr int kMaxP = 8;

template <template <int, int> class K, int... Is>
constexpr auto MakeTable(std::integer_sequence<int, Is...>) {
  struct Table {
    TileFn fn[kMaxR][kMaxP];
  } t{};
  ((t.fn[Is / kMaxP][Is % kMaxP] = K<Is / kMaxP + 1, Is % kMaxP + 1>::fn), ...);
  return t;
}
template <int R, int P>
struct Avx512Tile {
  static constexpr TileFn fn = &TileAvx512<R, P>;
};
template <int R, int P>
struct Avx2Tile {
  static constexpr TileFn fn = &TileAvx2<R, P>;
};
const auto kAvx512Table = MakeTable<Avx512Tile>(std::make_integer_sequence<int, kMaxR * kMaxP>{});
const auto kAvx2Table = MakeTable<Avx2Tile>(std::make_integer_sequence<int, kMaxR * kMaxP>{});

using SplitTileFn = void (*)(const GemmArgs*, int shards, int i0, int p0);
constexpr int kSplitRows = 3;  // kFewRows - 1

template <template <int, int> class K, int... Is>
constexpr auto MakeSplitTable(std::integer_sequence<int, Is...>) {
  struct Table {
    SplitTileFn fn[kSplitRows][kMaxP];
  } t{};
  ((t.fn[Is / kMaxP][Is % kMaxP] = K<Is / kMaxP + 1, Is % kMaxP + 1>::fn), ...);
  return t;
}
template <int R, int P>
struct Avx512SplitTile {
  static constexpr SplitTileFn fn = &TileAvx512Split<R, P>;
};
template <int R, int P>
struct Avx2SplitTile {
  static constexpr SplitTileFn fn = &TileAvx2Split<R, P>;
};
const auto kAvx512SplitTable =
    MakeSplitTable<Avx512SplitTile>(std::make_integer_sequence<int, kSplitRows * kMaxP>{});
const auto kAvx2SplitTable =
    MakeSplitTable<Avx2SplitTile>(std::make_integer_sequence<int, kSplitRows * kMaxP>{});

// Register blocking: rows R x panels P per tile, chosen from m only for speed
// (the bits do not depend on it).
void Blocking(Isa isa, int m, int* r, int* p) {
  if (isa == Isa::kAvx512) {  // 32 zmm: R * P <= 24 accumulators
    if (m == 1) { *r = 1; *p = 8; }
    else if (m <= 3) { *r = m; *p = 8; }
    else if (m <= 5) { *r = m; *p = 24 / m; }
    else if (m == 7 || m == 8) { *r = m; *p = 3; }
    else { *r = 6; *p = 4; }
  } else {  // AVX2, 16 ymm: 2 * R * P <= 12 accumulators
    if (m == 1) { *r = 1; *p = 4; }
    else if (m == 2) { *r = 2; *p = 3; }
    else { *r = 3; *p = 2; }
  }
}

void GemmPanels(const GemmArgs& a, Isa isa, int panel_begin, int panel_end) {
  int rb, pb;
  Blocking(isa, a.m, &rb, &pb);
  const int kc = a.m < kFewRows ? std::max(1, a.k) : kKc;
  // Panel group outermost: its weights are read from memory once, in order;
  // x (m x k) is re-read from cache for every group.
  for (int p0 = panel_begin; p0 < panel_end; p0 += pb) {
    const int np = std::min(pb, panel_end - p0);
    for (int k0 = 0; k0 < a.k || k0 == 0; k0 += kc) {
      const int k1 = std::min(a.k, k0 + kc);
      for (int i0 = 0; i0 < a.m; i0 += rb) {
        const int nr = std::min(rb, a.m - i0);
        switch (isa) {
          case Isa::kAvx512: kAvx512Table.fn[nr - 1][np - 1](a, i0, p0, k0, k1); break;
          case Isa::kAvx2: kAvx2Table.fn[nr - 1][np - 1](a, i0, p0, k0, k1); break;
          case Isa::kPortable: TilePortable(a, i0, nr, p0, np, k0, k1); break;
        }
      }
      if (a.k == 0) break;
    }
  }
}

// Splits a GEMM's panels between the pool's threads. Where every thread
// gets at least three units, each streams its own contiguous home range and
// the last units even out between threads that got unequal bandwidth
// (ParallelForStealing; session 46: the 189M model's batch-1 decode at 2
// threads read 1-4 % more of the paired probe,
// bench/results/cpu_vs_llamacpp/session-46.md). A unit is the smallest
// whole number of tiles of at least 8 panels, so every tile but a matrix's
// last is full width. Smaller matrices keep one range per thread, whose
// few microseconds do not repay the claims. Any cut gives the same bits:
// every output column is one chain over k.
template <class F>
void ForPanels(ThreadPool* pool, int panels, int pb, int64_t grain, F&& fn) {
  const int64_t unit = pb * ((8 + pb - 1) / pb);
  if (pool != nullptr && pool->threads() > 1 &&
      ThreadPool::StealingUnits(panels, unit) >= 3 * pool->threads()) {
    pool->ParallelForStealing(panels, unit, fn);
    return;
  }
  ParallelFor(pool, panels, grain, fn);
}

}  // namespace

void Gemm(const float* x, const PackedWeights& w, const float* bias, float* y, int m,
          ThreadPool* pool) {
  if (m <= 0 || w.n() <= 0) return;
  const GemmArgs a{x, w.data(), bias, y, m, w.n(), w.k(), w.k(), static_cast<size_t>(w.k()) * kP};
  const Isa isa = ActiveIsa();
  // Threads split the panels (columns): each keeps its own weights hot and
  // no chain is split. Grain: about 32 KiB of weights per range.
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max(1, w.k()));
  int rb, pb;
  Blocking(isa, m, &rb, &pb);
  ForPanels(pool, w.panels(), pb, grain, [&](int64_t b, int64_t e) {
    GemmPanels(a, isa, static_cast<int>(b), static_cast<int>(e));
  });
}

void GemmSplitK(const float* x, const PackedWeights& w, const int* k_bounds, int shards, float* y,
                float* scratch, int m, ThreadPool* pool) {
  if (m <= 0 || w.n() <= 0 || shards <= 0) return;
  constexpr int kMaxShards = 1 << (kMaxSplitLevels - 1);
  // A caller bug (ops.h: 1, 2, 4 or 8 shards).
  if (shards > kMaxShards || (shards & (shards - 1)) != 0) std::abort();
  const int n = w.n(), k = w.k();
  const Isa isa = ActiveIsa();
  const size_t plane = static_cast<size_t>(m) * n;
  auto out = [&](int s) { return s == 0 ? y : scratch + static_cast<size_t>(s - 1) * plane; };
  const int64_t grain = std::max<int64_t>(1, 2048 / std::max(1, k));
  GemmArgs args[kMaxShards];
  for (int s = 0; s < shards; ++s) {
    const int k0 = k_bounds[s], k1 = k_bounds[s + 1];
    args[s] = GemmArgs{x + k0, w.data() + static_cast<size_t>(k0) * kP, nullptr, out(s), m, n,
                       k1 - k0, k, static_cast<size_t>(k) * kP};
  }
  int rb, pb;
  Blocking(isa, m, &rb, &pb);
  if (m < kFewRows && isa != Isa::kPortable) {
    static_assert(kFewRows - 1 == kSplitRows);
    ForPanels(pool, w.panels(), pb, grain, [&](int64_t b, int64_t e) {
      for (int p0 = static_cast<int>(b); p0 < e; p0 += pb) {
        const int np = std::min(pb, static_cast<int>(e) - p0);
        const SplitTileFn fn = isa == Isa::kAvx512 ? kAvx512SplitTable.fn[m - 1][np - 1]
                                                   : kAvx2SplitTable.fn[m - 1][np - 1];
        fn(args, shards, 0, p0);
      }
    });
    return;
  }
  ParallelFor(pool, w.panels(), grain, [&](int64_t b, int64_t e) {
    // Panel group outermost, shards inside: a panel's [k][16] weights are
    // read in order, shard after shard, and the tree runs on hot partials.
    for (int p0 = static_cast<int>(b); p0 < e; p0 += pb) {
      const int p1 = std::min(static_cast<int>(e), p0 + pb);
      for (int s = 0; s < shards; ++s) GemmPanels(args[s], isa, p0, p1);
      // The fixed tree over these columns: level by level, shard s takes in
      // shard s + step (step = 1, 2, 4, ...).
      const int c0 = p0 * kP, c1 = std::min(n, p1 * kP);
      for (int step = 1; step < shards; step *= 2) {
        for (int s = 0; s + step < shards; s += 2 * step) {
          float* dst = out(s);
          const float* src = out(s + step);
          for (int i = 0; i < m; ++i) {
            float* d = dst + static_cast<size_t>(i) * n;
            const float* r = src + static_cast<size_t>(i) * n;
            for (int j = c0; j < c1; ++j) d[j] += r[j];
          }
        }
      }
    }
  });
}

void Gemm(const float* x, const float* w, const float* bias, float* y, int m, int n, int k,
          ThreadPool* pool) {
  const PackedWeights packed = PackWeights(w, n, k);
  Gemm(x, packed, bias, y, m, pool);
}

}  // namespace tandem::kernels::cpu

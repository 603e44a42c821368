// The attention operators' geometries: the int list each one takes (``int[] geometry`` in its schema) as a struct of
// named fields, written once per operator as a field list from which the struct, its names and its parsing are all
// generated, so they cannot disagree. Python holds a frozen dataclass of the same fields (``fused/geometry.py``) and
// compares its names with ``geometry_fields(which)`` (ops.cpp) once when the library loads: the list's positions mean
// the same on both sides of the boundary.
//
// Why an int list and not a registered custom class: an int list is a plain value to torch.compile (the operators'
// fake implementations read it as one), where a script object needs a fake class of its own to be traced.
#pragma once

#include "checks.h"

#include <array>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace routeformer {

constexpr int64_t kAnyInt = std::numeric_limits<int64_t>::min();  // a field that takes every int64

// X(type, name, least): a field of the list, in its order; ``least`` is the least value an int64 field takes
// (kAnyInt: any), and unused for a flag (a bool field takes 0 or 1).
#define RF_BAND_GEOMETRY(X)                                                                                        \
  X(int64_t, block, 1)              /* a tiling block's rows (queries, and keys per span block) */                 \
  X(int64_t, back, 0)               /* key blocks behind a query block */                                         \
  X(int64_t, ahead, 0)              /* key blocks ahead of it */                                                  \
  X(int64_t, rows, 0)               /* query rows per tile when queries are not at key positions (0: none) */     \
  X(bool, single, 0)                /* one tile of every query and key */                                         \
  X(bool, has_offsets, 0)           /* offsets that are not a window's: each row to [i + off_lo, i + off_hi] */   \
  X(int64_t, off_lo, kAnyInt)                                                                                      \
  X(int64_t, off_hi, kAnyInt)                                                                                      \
  X(int64_t, window, 0)             /* a sliding window (0: none): each row to [i + 1 - window, i] */              \
  X(bool, causal, 0)                /* that window's side: to [i + 1 - window, i + window - 1] when not */        \
  X(bool, exclude_self, 0)          /* the own key only when a row sees nothing else */                           \
  X(int64_t, unit, 0)               /* relative distances (key - query) · unit; 0: from delta or positions */     \
  X(int64_t, max_distance, 0)       /* the relative tables' clipping distance */                                  \
  X(int64_t, rows_per_block, 1)     /* the kernel's blocks of consecutive rows (the blocking alone) */            \
  X(bool, positions_from_order, 0)  /* relative distances between the order's entries (order[j] - order[i]) */

#define RF_RANGES_GEOMETRY(X)                                                                                      \
  X(int64_t, merge, 1)           /* entries per query row, merged into one softmax */                             \
  X(int64_t, rows_per_block, 1)  /* entries per kernel block (the blocking alone) */                              \
  X(int64_t, span_cap, 1)        /* the most keys a block's ranges span together (the blocking alone) */          \
  X(int64_t, max_distance, 0)    /* the relative tables' clipping distance */

#define RF_ROUNDS_GEOMETRY(X)                                                                                      \
  X(int64_t, window, 1)          /* each round's sliding window over its sorted order */                          \
  X(int64_t, rows_per_block, 1)  /* sorted indices per kernel block (the blocking alone) */                       \
  X(bool, causal, 0)

namespace geometry {

// Reads an operator's int list field by field, in the field list's order, each checked by name:
// "routeformer_fused.<op>: geometry[0] (block) must be >= 1, got 0".
class Reader {
 public:
  Reader(const char* op, at::IntArrayRef list, const std::vector<std::string>& names) : op_(op), list_(list) {
    if (list.size() != names.size()) {
      std::string all;
      for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
      RF_CHECK(false, op, "geometry must hold ", names.size(), " integers (", all, "), got ", list.size());
    }
  }
  template <typename V>
  V next(const char* name, int64_t least) {
    const size_t at = at_++;
    const int64_t x = list_[at];
    if constexpr (std::is_same_v<V, bool>) {
      RF_CHECK(x == 0 || x == 1, op_, "geometry[", at, "] (", name, ") must be 0 or 1, got ", x);
      return x == 1;
    } else {
      RF_CHECK(least == kAnyInt || x >= least, op_, "geometry[", at, "] (", name, ") must be >= ", least, ", got ",
               x);
      return x;
    }
  }

 private:
  const char* op_;
  at::IntArrayRef list_;
  size_t at_ = 0;
};

}  // namespace geometry

#define RF_GEOMETRY_MEMBER(type, name, least) type name;
#define RF_GEOMETRY_NAME(type, name, least) #name,
#define RF_GEOMETRY_READ(type, name, least) g.name = in.next<type>(#name, least);

// struct NAME { the fields; names(); parse(op, list) }, from a field list
#define RF_DEFINE_GEOMETRY(NAME, FIELDS)                                                                           \
  struct NAME {                                                                                                    \
    FIELDS(RF_GEOMETRY_MEMBER)                                                                                     \
    static const std::vector<std::string>& names() {                                                              \
      static const std::vector<std::string> n = {FIELDS(RF_GEOMETRY_NAME)};                                       \
      return n;                                                                                                    \
    }                                                                                                              \
    static NAME parse(const char* op, at::IntArrayRef list) {                                                     \
      geometry::Reader in(op, list, names());                                                                      \
      NAME g;                                                                                                      \
      FIELDS(RF_GEOMETRY_READ)                                                                                     \
      return g;                                                                                                    \
    }                                                                                                              \
  };

RF_DEFINE_GEOMETRY(BandGeometry, RF_BAND_GEOMETRY)
RF_DEFINE_GEOMETRY(RangesGeometry, RF_RANGES_GEOMETRY)
RF_DEFINE_GEOMETRY(RoundsGeometry, RF_ROUNDS_GEOMETRY)

}  // namespace routeformer

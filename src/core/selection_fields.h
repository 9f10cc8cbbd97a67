// The selection's fields, listed once: each field's name, its member of SelectionParams (sparse.h, where its default
// is set) and its shape-free check. check_selection_params (api/validate.cpp) and the Python binding's
// SelectionParams (python/src/bind_sparse.cpp: its keywords, attributes and repr) iterate this list; the Python side
// reads the binding. A new field: a member of SelectionParams, a line here, its meaning in build_index()'s "Selection
// arguments" and docs/semantics.md (docs/architecture.md, "Where new work goes", lists the rest).
#pragma once

#include "sparse_prefill/sparse.h"

namespace sparse_prefill {

// What check_selection_params asks of a field (its message names the field and, but for kNonNegative, the value).
enum class FieldCheck {
  kNone,                  // any value of its type (the flags)
  kUnitInterval,          // [0, 1]
  kOpenUnitInterval,      // (0, 1]
  kPositiveMultipleOf64,  // block_size
  kNonNegative,           // >= 0
  kRank,                  // 16 or 32 (the ranks the key_max kernels are built for)
  kRule,                  // a SelectionRule
  kSubgroups,             // 0 (one selection per query head) or >= 1 (a divisor of g: checked with the shapes)
  kBudget,                // -1 (the causal bound) or [0, 2^31 - 1]
};

// Calls f(name, &SelectionParams::member, check) for every field, in the binding's keyword order.
template <class F>
void for_each_selection_field(F&& f) {
  f("alpha", &SelectionParams::alpha, FieldCheck::kUnitInterval);
  f("mean_alpha", &SelectionParams::mean_alpha, FieldCheck::kUnitInterval);
  f("key_rank", &SelectionParams::key_rank, FieldCheck::kRank);
  f("candidate_alpha", &SelectionParams::candidate_alpha, FieldCheck::kUnitInterval);
  f("rule", &SelectionParams::rule, FieldCheck::kRule);
  f("block_size", &SelectionParams::block_size, FieldCheck::kPositiveMultipleOf64);
  f("sink", &SelectionParams::sink, FieldCheck::kNonNegative);
  f("window", &SelectionParams::window, FieldCheck::kNonNegative);
  f("last_n", &SelectionParams::last_n, FieldCheck::kNonNegative);
  f("correction", &SelectionParams::correction, FieldCheck::kNone);
  f("final_chunk", &SelectionParams::final_chunk, FieldCheck::kNone);
  f("union_lists", &SelectionParams::union_lists, FieldCheck::kNone);
  f("head_subgroups", &SelectionParams::head_subgroups, FieldCheck::kSubgroups);
  f("dense_fraction", &SelectionParams::dense_fraction, FieldCheck::kOpenUnitInterval);
  f("max_kept_blocks", &SelectionParams::max_kept_blocks, FieldCheck::kBudget);
}

}  // namespace sparse_prefill

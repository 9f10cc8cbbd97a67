// FlashPrefill V2 selection, exactly: pooled block means, per-tile scores s_rJ = scale * q_r . k_mean_J over the
// blocks each packed row can see, tile maximum M, block energies E_J = sum_r exp(s_rJ - M), the alpha * max_J E_J
// threshold (or, SelectionRule::kRowMax, max_r (s_rJ - m_r) >= ln alpha with m_r the row's maximum score;
// kProbeRowMax, the same test on the exact block masses of probe rows, plus kRowMax at mean_alpha; kProbeRowMass,
// the probe rows' test against each row's whole mass instead of its top block; kKeyMax, per-key block maxima on a
// low-rank residual with a one-pass threshold, docs/design/key_max_spec.md; kExactMax, exact block maxima over the
// pooled row max's candidates in one pass, docs/design/exact_max_spec.md), the always-kept rules, CSR compaction
// and the dense rule (SelectionParams::dense_fraction). Also the chunked-prefill union lowering.
#include <algorithm>
#include <cmath>

#include "core/contract.h"
#include "core/dtype_convert.h"
#include "reference/parallel.h"
#include "reference/reference.h"

namespace sparse_prefill::reference {
namespace {

// kExactMax's units (exact_max_spec.md step 3): the keys that share one e4m3 scale, the CUDA stage's GEMM N
// (kUnitKeys).
constexpr int kExactUnitKeys = 64;

// Blocks that some row of the tile sees (at least one key).
std::vector<char> tile_visible_blocks(const AttentionInputs& in, const SequenceInfo& s, const TileGeometry& geo,
                                      int block_size, int64_t nb) {
  std::vector<char> visible(size_t(nb), 0);
  for (int64_t pos = geo.first_pos; pos <= geo.last_pos; ++pos) {
    const KeyRange r = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
    if (r.empty()) continue;
    for (int64_t J = r.lo / block_size; J <= r.hi / block_size; ++J) visible[J] = 1;
  }
  return visible;
}

std::vector<int64_t> segment_offsets(const Problem& p) {
  std::vector<int64_t> off(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) off[b + 1] = off[b] + int64_t(p.num_kv_heads) * num_tiles(p.seqs[b].q_len, p.group_size);
  return off;
}

// Concatenates per-segment lists into the CSR arrays.
void compact(const std::vector<std::vector<int32_t>>& lists, BlockIndex& index) {
  index.segment_start.resize(lists.size());
  index.segment_end.resize(lists.size());
  index.block_ids.clear();
  for (size_t s = 0; s < lists.size(); ++s) {
    index.segment_start[s] = int32_t(index.block_ids.size());
    index.block_ids.insert(index.block_ids.end(), lists[s].begin(), lists[s].end());
    index.segment_end[s] = int32_t(index.block_ids.size());
  }
}

// kExactMax's operands (exact_max_spec.md step 3): the n values x rounded to float8 e4m3 after scaling their
// largest magnitude to 448, as the CUDA stage rounds them (float32: inv = 448 / amax, 0 when amax is 0; e4m3 of
// x * inv, nearest even, saturating); out gets the e4m3 values, the return is the scale amax / 448 they carry. A NaN
// is not a magnitude (as fmaxf) and stays NaN.
float round_e4m3_scaled(const float* x, int64_t n, float* out) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 448.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i) out[i] = fp8e4m3_to_float(float_to_fp8e4m3(x[i] * inv));
  return amax / 448.f;
}

}  // namespace

void pool_kv(const Problem& p, const std::vector<SequenceKV>& kv, int block_size, std::vector<int32_t>& cu_blocks,
             std::vector<float>& k_mean, std::vector<float>* v_mean) {
  const int D = p.head_dim, H = p.num_kv_heads;
  cu_blocks.assign(p.batch + 1, 0);
  for (int b = 0; b < p.batch; ++b) cu_blocks[b + 1] = cu_blocks[b] + int32_t(num_blocks(p.seqs[b].k_len, block_size));
  k_mean.assign(size_t(cu_blocks[p.batch]) * H * D, 0.f);
  if (v_mean) v_mean->assign(k_mean.size(), 0.f);
  parallel_for(int64_t(p.batch) * H, [&](int64_t item) {
    const int b = int(item / H), h = int(item % H);
    const SequenceKV& s = kv[item];
    std::vector<double> ks(D), vs(D);
    for (int64_t J = 0; J < num_blocks(s.len, block_size); ++J) {
      const int64_t lo = J * block_size, hi = std::min<int64_t>(lo + block_size, s.len);
      std::fill(ks.begin(), ks.end(), 0.0);
      std::fill(vs.begin(), vs.end(), 0.0);
      for (int64_t j = lo; j < hi; ++j) {
        for (int d = 0; d < D; ++d) ks[d] += s.k[size_t(j) * D + d];
        if (v_mean)
          for (int d = 0; d < D; ++d) vs[d] += s.v[size_t(j) * D + d];
      }
      const size_t off = (size_t(cu_blocks[b] + J) * H + h) * D;
      for (int d = 0; d < D; ++d) {
        k_mean[off + d] = float(ks[d] / double(hi - lo));
        if (v_mean) (*v_mean)[off + d] = float(vs[d] / double(hi - lo));
      }
    }
  });
}

BlockIndex build_index(const AttentionInputs& in, const Problem& p, const SelectionParams& params, bool v_means) {
  const int S = resolve_head_subgroups(params.head_subgroups, p.group_size);  // the request's S
  if (S > 1) {  // the S = 1 selection on the model with Hkv * S KV heads
    const VirtualHeadCopies virt = virtual_head_copies(in, p, S);
    SelectionParams one = params;
    one.head_subgroups = 1;
    BlockIndex index = build_index(virt.in, virt.p, one, v_means);
    index.num_subgroups = S;
    return index;
  }
  BlockIndex index;
  index.block_size = params.block_size;
  index.group_size = p.group_size;
  index.num_kv_heads = p.num_kv_heads;
  index.head_dim = p.head_dim;
  index.correction = params.correction;
  const std::vector<SequenceKV> kv = gather_kv(in, p);
  // V means only where something reads them (the correction, a mean cache): an index without them has none.
  pool_kv(p, kv, params.block_size, index.cu_blocks, index.k_mean,
          params.correction || v_means ? &index.v_mean : nullptr);

  const int D = p.head_dim, g = p.group_size, B = params.block_size, H = p.num_kv_heads;
  // kKeyMax: per (sequence, KV head) its basis and every key's residual coordinates in it. Under head sub-groups
  // these are the virtual heads, copies of their KV head's keys: the same arithmetic on the same keys gives each
  // copy its KV head's basis, bit for bit (the spec's basis per KV head, not per sub-group).
  const int R = params.key_rank;
  std::vector<std::vector<double>> key_basis_of, key_coords_of;
  if (params.rule == SelectionRule::kKeyMax) {
    key_basis_of.resize(kv.size());
    key_coords_of.resize(kv.size());
    parallel_for(int64_t(kv.size()), [&](int64_t item) {
      const float* km = &index.k_mean[(size_t(index.cu_blocks[item / H]) * H + item % H) * D];
      key_basis_of[item] = key_basis(kv[item], km, int64_t(H) * D, D, R, B);
      key_coords_of[item] = key_coordinates(kv[item], km, int64_t(H) * D, D, key_basis_of[item], R, B);
    });
  }
  // kExactMax: every key rounded to e4m3 per unit of 64 keys of its sequence and KV head (keys past the sequence
  // zero), and each unit's scale (exact_max_spec.md step 3).
  std::vector<std::vector<float>> exact_keys_of, exact_scales_of;
  if (params.rule == SelectionRule::kExactMax) {
    exact_keys_of.resize(kv.size());
    exact_scales_of.resize(kv.size());
    parallel_for(int64_t(kv.size()), [&](int64_t item) {  // the zeros past the sequence add nothing to a unit's amax
      const SequenceKV& s = kv[item];
      std::vector<float>& keys = exact_keys_of[item];
      keys.assign(s.k.begin(), s.k.begin() + s.len * D);
      for (int64_t lo = 0; lo < s.len; lo += kExactUnitKeys) {
        const int64_t n = std::min<int64_t>(kExactUnitKeys, s.len - lo) * D;
        exact_scales_of[item].push_back(round_e4m3_scaled(&keys[size_t(lo) * D], n, &keys[size_t(lo) * D]));
      }
    });
  }
  const std::vector<int64_t> seg_offset = segment_offsets(p);
  std::vector<std::vector<int32_t>> lists(size_t(seg_offset[p.batch]));
  parallel_for(seg_offset[p.batch], [&](int64_t seg) {
    const int b = int(std::upper_bound(seg_offset.begin(), seg_offset.end(), seg) - seg_offset.begin() - 1);
    const SequenceInfo& s = p.seqs[b];
    const int64_t tiles = num_tiles(s.q_len, g);
    const int kvh = int((seg - seg_offset[b]) / tiles);
    const int64_t tile = (seg - seg_offset[b]) % tiles;
    const int64_t nb = num_blocks(s.k_len, B);
    const TileGeometry geo = tile_geometry(tile, s.q_len, g);
    const std::vector<char> visible = tile_visible_blocks(in, s, geo, B, nb);

    // Scores of every row against the pooled keys it sees; tile maximum.
    const float* k_mean = &index.k_mean[size_t(index.cu_blocks[b]) * H * D];
    const int64_t rows = geo.row_end - geo.row_begin;
    std::vector<double> score(size_t(rows * nb), -std::numeric_limits<double>::infinity());
    std::vector<float> q(D);
    auto load_q = [&](int64_t pos, int h) {  // query `pos` of the sequence, head h, into q
      const int64_t qo = (s.q_start + pos) * in.q.stride[0] + h * in.q.stride[1];
      const float scale = descale_at(in.q_descale, b, h, p.num_q_heads);
      for (int d = 0; d < D; ++d) q[d] = load_as_float(in.q.data, p.dtype, qo + d) * scale;
    };
    auto mean_dot = [&](int64_t J) { return dot(q.data(), k_mean + (size_t(J) * H + kvh) * D, D); };  // q . k_mean_J
    double tile_max = -std::numeric_limits<double>::infinity();
    bool tile_nan = false;  // a NaN score (NaN in q or in a block's keys): the tile keeps every visible block
    for (int64_t r = geo.row_begin; r < geo.row_end; ++r) {
      const int64_t pos = r / g;
      const int h = kvh * g + int(r % g);
      const KeyRange keys = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
      if (keys.empty()) continue;
      load_q(pos, h);
      for (int64_t J = keys.lo / B; J <= keys.hi / B; ++J) {
        const double sc = double(p.softmax_scale) * mean_dot(J);
        score[size_t((r - geo.row_begin) * nb + J)] = sc;
        if (std::isnan(sc)) tile_nan = true;
        tile_max = std::max(tile_max, sc);
      }
    }
    // The blocks kept whatever the scores: not prunable (not fully visible to the tile), sink, window band, last tiles.
    const bool last_tile = tile >= tiles - (params.final_chunk ? params.last_n : 0);
    std::vector<char> band(size_t(nb), 0);
    if (params.window > 0) {
      for (int64_t pos = geo.first_pos; pos <= geo.last_pos; ++pos) {
        const KeyRange keys = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
        const int64_t diag = pos + s.k_len - s.q_len;
        const int64_t lo = std::max(keys.lo, diag - params.window + 1), hi = std::min(keys.hi, diag);
        if (lo > hi) continue;
        for (int64_t J = lo / B; J <= hi / B; ++J) band[J] = 1;
      }
    }
    auto always_kept = [&](int64_t J) {
      return last_tile || J * B < params.sink || band[J] || !block_fully_visible(in, s, geo, J, B);
    };
    // The threshold test of each visible block (SelectionParams::rule).
    std::vector<char> above(size_t(nb), 0);
    constexpr double kNegInf = -std::numeric_limits<double>::infinity();
    // Per row: m_r = max_J w_rJ over the blocks the row sees (relative_to_mass: m_r = log sum_J exp(w_rJ), the
    // row's whole mass when w are exact log-masses); C_J = max over the rows that see J of w_rJ - m_r.
    auto row_max_closeness = [&](const std::vector<double>& w, std::vector<double>& closeness,
                                 bool relative_to_mass = false) {
      for (int64_t r = 0; r < rows; ++r) {
        const double* wr = &w[size_t(r * nb)];
        double row_max = kNegInf;
        for (int64_t J = 0; J < nb; ++J) row_max = std::max(row_max, wr[J]);
        if (row_max == kNegInf) continue;  // the row sees no block (or is not a probe row)
        if (relative_to_mass) {
          double sum = 0;
          for (int64_t J = 0; J < nb; ++J) sum += wr[J] == kNegInf ? 0.0 : std::exp(wr[J] - row_max);
          row_max += std::log(sum);
        }
        for (int64_t J = 0; J < nb; ++J) {
          if (wr[J] != kNegInf) closeness[J] = std::max(closeness[J], wr[J] - row_max);
        }
      }
    };
    const double log_alpha = params.alpha > 0.f ? std::log(double(params.alpha)) : kNegInf;
    // kKeyMax / kExactMax (key_max_spec.md step 4): per row of the loaded q, the pass from the diagonal down over the
    // blocks `scored` admits, m_J = max(bound, running maximum of sh_J'), C_J = max over the rows of scale (sh_J - m_J);
    // the bound the larger of `pooled_whole` (max q . k_mean_J over the blocks the row sees whole) and the row's exact
    // maximum over the sink keys it sees.
    const SequenceKV& keys_of = kv[size_t(b) * H + kvh];
    const int64_t sink_end = std::min<int64_t>(s.k_len, num_blocks(params.sink, B) * B);  // the sink blocks' keys
    auto sees_whole = [&](const KeyRange& keys, int64_t J) {
      return J * B >= keys.lo && std::min<int64_t>(J * B + B, s.k_len) - 1 <= keys.hi;
    };
    // sink_score(j): the row's score of sink key j in the bound (kKeyMax: exact; kExactMax: on its e4m3 operands).
    auto one_pass = [&](const KeyRange& keys, double pooled_whole, const std::vector<double>& sh, auto scored,
                        auto sink_score, std::vector<double>& closeness) {
      double bound = pooled_whole;
      for (int64_t j = keys.lo; j <= std::min(keys.hi, sink_end - 1); ++j) bound = std::max(bound, sink_score(j));
      double running = kNegInf;
      for (int64_t J = keys.hi / B; J >= keys.lo / B; --J) {
        if (!scored(J)) continue;
        running = std::max(running, sh[J]);
        closeness[J] = std::max(closeness[J], double(p.softmax_scale) * (sh[J] - std::max(bound, running)));
      }
    };
    if (params.rule == SelectionRule::kRowMax) {
      // keep iff C_J >= ln(alpha) (ln 0 = -inf: every visible block)
      std::vector<double> closeness(size_t(nb), kNegInf);
      row_max_closeness(score, closeness);
      for (int64_t J = 0; J < nb; ++J) above[J] = visible[J] && closeness[J] >= log_alpha;
    } else if (is_probe_rule(params.rule)) {
      // Probe rows: the exact log-mass of each block they see (double), then the row-max test at alpha; the rest
      // of the tile's rows through the pooled means at params.mean_alpha.
      std::vector<double> mass(size_t(rows * nb), kNegInf), logit;
      for (int64_t r = geo.row_begin; r < geo.row_end; ++r) {
        const int64_t pos = r / g;
        if (pos % kProbeStride != kProbeStride - 1 && pos != s.q_len - 1) continue;
        const int h = kvh * g + int(r % g);
        const KeyRange keys = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
        if (keys.empty()) continue;
        load_q(pos, h);
        for (int64_t J = keys.lo / B; J <= keys.hi / B; ++J) {
          const int64_t lo = std::max(keys.lo, J * B), hi = std::min(keys.hi, J * B + B - 1);
          logit.assign(size_t(hi - lo + 1), 0.0);
          double top = kNegInf;
          for (int64_t j = lo; j <= hi; ++j) {
            logit[size_t(j - lo)] = double(p.softmax_scale) * dot(q.data(), &keys_of.k[size_t(j) * D], D);
            top = std::max(top, logit[size_t(j - lo)]);
          }
          double sum = 0;
          for (double x : logit) sum += std::exp(x - top);
          const double w = top + std::log(sum);
          if (std::isnan(w)) tile_nan = true;
          mass[size_t((r - geo.row_begin) * nb + J)] = w;
        }
      }
      std::vector<double> probe(size_t(nb), kNegInf), mean(size_t(nb), kNegInf);
      row_max_closeness(mass, probe, params.rule == SelectionRule::kProbeRowMass);
      row_max_closeness(score, mean);
      const double log_mean_alpha = params.mean_alpha > 0.f ? std::log(double(params.mean_alpha)) : kNegInf;
      for (int64_t J = 0; J < nb; ++J)
        above[J] = visible[J] && (probe[J] >= log_alpha || mean[J] >= log_mean_alpha);
    } else if (params.rule == SelectionRule::kKeyMax) {
      // Per row: sh_J = q . k_mean_J + max over the keys j of J it sees of (P^T q) . (P^T x_j) (unscaled); one pass
      // from the diagonal down, m_J = max(bound, max_{J' >= J} sh_J') with the bound the larger of max q . k_mean_J
      // over the blocks the row sees whole and max q . k_j over the sink keys it sees (exact); C_J = max over the
      // rows that see J of scale (sh_J - m_J).
      const std::vector<double>& P = key_basis_of[size_t(b) * H + kvh];
      const std::vector<double>& coords = key_coords_of[size_t(b) * H + kvh];
      std::vector<double> closeness(size_t(nb), kNegInf), sh(static_cast<size_t>(nb)), pq(static_cast<size_t>(R));
      for (int64_t r = geo.row_begin; r < geo.row_end; ++r) {
        const int64_t pos = r / g;
        const KeyRange keys = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
        if (keys.empty()) continue;
        load_q(pos, kvh * g + int(r % g));
        for (int c = 0; c < R; ++c) {
          double sum = 0;
          for (int d = 0; d < D; ++d) sum += P[size_t(d) * R + c] * double(q[d]);
          pq[c] = sum;
        }
        double pooled_whole = kNegInf;
        for (int64_t J = keys.lo / B; J <= keys.hi / B; ++J) {
          const double md = mean_dot(J);
          double top = kNegInf;
          for (int64_t j = std::max(keys.lo, J * B); j <= std::min(keys.hi, J * B + B - 1); ++j) {
            double proj = 0;
            for (int c = 0; c < R; ++c) proj += pq[c] * coords[size_t(j) * R + c];
            top = std::max(top, proj);
          }
          sh[J] = md + top;
          if (std::isnan(sh[J])) tile_nan = true;
          if (sees_whole(keys, J)) pooled_whole = std::max(pooled_whole, md);
        }
        one_pass(
            keys, pooled_whole, sh, [](int64_t) { return true; },
            [&](int64_t j) { return dot(q.data(), &keys_of.k[size_t(j) * D], D); }, closeness);
      }
      for (int64_t J = 0; J < nb; ++J) above[J] = visible[J] && closeness[J] >= log_alpha;
    } else if (params.rule == SelectionRule::kExactMax) {
      // docs/design/exact_max_spec.md. Scored blocks C: kRowMax at candidate_alpha over the pooled scores less the
      // always-kept blocks, plus the blocks not fully visible to the tile. Per row: e_J = max over the keys j of J in
      // C it sees of its e4m3 score (step 3; unscaled); one pass from the diagonal down over C, m_J = max(bound,
      // max_{J' in C, J' >= J} e_J'), the bound as kKeyMax's but the sink keys' scores on the same e4m3 operands;
      // C_J = max over the rows that see J of scale (e_J - m_J).
      std::vector<double> pooled(size_t(nb), kNegInf);
      row_max_closeness(score, pooled);
      const double log_cand = params.candidate_alpha > 0.f ? std::log(double(params.candidate_alpha)) : kNegInf;
      std::vector<char> cand(size_t(nb), 0);
      for (int64_t J = 0; J < nb; ++J)
        cand[J] = visible[J] && ((pooled[J] >= log_cand && !always_kept(J)) || !block_fully_visible(in, s, geo, J, B));
      std::vector<double> closeness(size_t(nb), kNegInf), e(static_cast<size_t>(nb));
      const std::vector<float>& k8 = exact_keys_of[size_t(b) * H + kvh];
      const std::vector<float>& k8_scale = exact_scales_of[size_t(b) * H + kvh];
      std::vector<float> q8(static_cast<size_t>(D));
      for (int64_t r = geo.row_begin; r < geo.row_end; ++r) {
        const int64_t pos = r / g;
        const KeyRange keys = visible_keys(pos, s.q_len, s.k_len, in.causal, in.window_left, in.window_right);
        if (keys.empty()) continue;
        load_q(pos, kvh * g + int(r % g));
        const double q8_scale = round_e4m3_scaled(q.data(), D, q8.data());
        auto score8 = [&](int64_t j) {  // spec step 3: sigma_r kappa_u(j) (q8_r . k8_j)
          return dot(q8.data(), &k8[size_t(j) * D], D) * q8_scale * double(k8_scale[size_t(j / kExactUnitKeys)]);
        };
        double pooled_whole = kNegInf;
        for (int64_t J = keys.lo / B; J <= keys.hi / B; ++J) {
          if (sees_whole(keys, J)) pooled_whole = std::max(pooled_whole, mean_dot(J));
          if (!cand[J]) continue;
          double top = kNegInf;  // NaN-propagating, as the kernel's maxima
          for (int64_t j = std::max(keys.lo, J * B); j <= std::min(keys.hi, J * B + B - 1); ++j) {
            const double x = score8(j);
            if (std::isnan(x) || x > top) top = x;
          }
          e[J] = top;
          if (std::isnan(top)) tile_nan = true;
        }
        one_pass(keys, pooled_whole, e, [&](int64_t J) { return cand[J] != 0; }, score8, closeness);
      }
      for (int64_t J = 0; J < nb; ++J) above[J] = cand[J] && closeness[J] >= log_alpha;
    } else {
      // Block energies and their maximum.
      std::vector<double> energy(size_t(nb), 0.0);
      double energy_max = 0;
      for (int64_t J = 0; J < nb; ++J) {
        if (!visible[J]) continue;
        for (int64_t r = 0; r < rows; ++r) {
          const double sc = score[size_t(r * nb + J)];
          if (sc != kNegInf) energy[J] += std::exp(sc - tile_max);
        }
        energy_max = std::max(energy_max, energy[J]);
      }
      for (int64_t J = 0; J < nb; ++J) above[J] = energy[J] >= double(params.alpha) * energy_max;
    }
    // Keep: above threshold, or always kept (not prunable, sink, window band, last tiles).
    std::vector<int32_t>& list = lists[size_t(seg)];
    for (int64_t J = 0; J < nb; ++J) {
      if (visible[J] && (tile_nan || above[J] || always_kept(J))) list.push_back(int32_t(J));
    }
  });
  compact(lists, index);
  count_density(in, p, index);
  if (params.union_lists) return union_index(in, p, index, params.dense_fraction);  // the rule applies to the union
  apply_dense_rule(in, p, index, params.dense_fraction);
  return index;
}

void apply_dense_rule(const AttentionInputs& in, const Problem& p, BlockIndex& index, float dense_fraction) {
  if (!keeps_all(index.kept_blocks, index.visible_blocks, dense_fraction)) return;
  const std::vector<int64_t> seg_offset = segment_offsets(p);
  std::vector<std::vector<int32_t>> lists(index.segment_start.size());
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo& s = p.seqs[b];
    const int64_t tiles = num_tiles(s.q_len, p.group_size), nb = num_blocks(s.k_len, index.block_size);
    for (int64_t t = 0; t < tiles; ++t) {
      const std::vector<char> visible =
          tile_visible_blocks(in, s, tile_geometry(t, s.q_len, p.group_size), index.block_size, nb);
      for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
        std::vector<int32_t>& list = lists[size_t(seg_offset[b] + kvh * tiles + t)];
        for (int64_t J = 0; J < nb; ++J) {
          if (visible[J]) list.push_back(int32_t(J));
        }
      }
    }
  }
  compact(lists, index);
  count_density(in, p, index);
}

void count_density(const AttentionInputs& in, const Problem& p, BlockIndex& index) {
  const std::vector<int64_t> seg_offset = segment_offsets(p);
  index.kept_blocks = index.visible_blocks = 0;
  for (int b = 0; b < p.batch; ++b) {
    const SequenceInfo& s = p.seqs[b];
    const int64_t tiles = num_tiles(s.q_len, p.group_size);
    const int64_t nb = num_blocks(s.k_len, index.block_size);
    for (int64_t t = 0; t < tiles; ++t) {
      const std::vector<char> visible =
          tile_visible_blocks(in, s, tile_geometry(t, s.q_len, p.group_size), index.block_size, nb);
      const int64_t visible_count = std::count(visible.begin(), visible.end(), char(1));
      for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
        const int64_t seg = seg_offset[b] + kvh * tiles + t;
        index.visible_blocks += visible_count;
        for (int32_t n = index.segment_start[seg]; n < index.segment_end[seg]; ++n) {
          index.kept_blocks += visible[index.block_ids[n]];
        }
      }
    }
  }
}

namespace {

// The union lowering of an index over p.num_kv_heads (virtual) KV heads.
BlockIndex union_of_tiles(const AttentionInputs& in, const Problem& p, const BlockIndex& index) {
  BlockIndex u = index;  // metadata (num_subgroups included) and pooled means carry over
  const std::vector<int64_t> seg_offset = segment_offsets(p);
  u.block_ids.clear();
  for (int b = 0; b < p.batch; ++b) {
    const int64_t tiles = num_tiles(p.seqs[b].q_len, p.group_size);
    const int64_t nb = num_blocks(p.seqs[b].k_len, index.block_size);
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      std::vector<char> in_union(size_t(nb), 0);
      const int64_t first = seg_offset[b] + kvh * tiles;
      for (int64_t seg = first; seg < first + tiles; ++seg) {
        for (int32_t n = index.segment_start[seg]; n < index.segment_end[seg]; ++n) in_union[index.block_ids[n]] = 1;
      }
      const int32_t start = int32_t(u.block_ids.size());
      for (int64_t J = 0; J < nb; ++J) {
        if (in_union[J]) u.block_ids.push_back(int32_t(J));
      }
      const int32_t end = int32_t(u.block_ids.size());
      for (int64_t seg = first; seg < first + tiles; ++seg) {
        u.segment_start[seg] = start;
        u.segment_end[seg] = end;
      }
    }
  }
  count_density(in, p, u);
  return u;
}

}  // namespace

BlockIndex union_index(const AttentionInputs& in, const Problem& p, const BlockIndex& index, float dense_fraction) {
  // Head sub-groups: one list per (sequence, virtual KV head), i.e. per sub-group. The union reads no K/V, so the
  // virtual problem is enough (count_density reads only the masks of `in`).
  const Problem vp = index.num_subgroups > 1 ? virtual_problem(p, index.num_subgroups) : p;
  BlockIndex u = union_of_tiles(in, vp, index);
  apply_dense_rule(in, vp, u, dense_fraction);
  return u;
}

}  // namespace sparse_prefill::reference

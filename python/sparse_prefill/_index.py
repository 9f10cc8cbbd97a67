"""The block index: Index, build_index(), the workspace sizes of the index-building calls, union_index(), pool_kv()
(conventions: sparse_prefill._api; the selection's parameters: _selection.py)."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _C
from ._arrays import ArrayLib, to_numpy
from ._call import LaunchOptions, _Call, _as_int, _as_int32, _kv_arrays, _mean_cache_arrays
from ._selection import Selection, _selection, selection_keywords



class Index:
    """A block-sparse selection (CSR over segments), produced by build_index() or union_index().

    A segment is one (sequence b, KV head, query tile); a tile is 128 PackGQA rows (row r <-> position r // g of query
    head kv_head * g + r % g, g = group_size). Segments are ordered by sequence, then KV head, then tile:
    id = segment_offsets[b] + kv_head * tiles[b] + tile. Segment s lists the kept block ids (per sequence, ascending)
    block_ids[segment_start[s]:segment_end[s]]; in union mode all tiles of a (sequence, KV head) share one list.

    Head sub-groups (num_subgroups = S > 1: the selection's head_subgroups, 0 resolved to g): the KV heads of the
    index are Hkv * S virtual heads; virtual head v holds query heads [v * g, (v + 1) * g) with g = group_size =
    (Hq // Hkv) // S and reads K/V head v // S, so num_kv_heads, group_size, kv_head in segment()/segment_id() and
    the head axis of k_mean/v_mean are all virtual (the means of virtual head v are those of K/V head v // S).

    Where it lives. An index built from CUDA arrays stays on the device (`on_device` is True): its CSR, pooled means
    and launch state live in one workspace array (`workspace`, in q's library, or the caller's `workspace=`), written
    and read on the stream without a host synchronisation; `to_host()` copies it to the host for inspection (it
    synchronises). An index built from CPU arrays, or returned by to_host() or union_index(), is a host index whose
    arrays are numpy arrays (`host`), copied once to another device when passed with arrays there.

    What it is bound to. `binding` records what the index was built for (mask, softmax scale, head geometry, length
    bounds, dtype, device, and the arrays it was built from); sparse_attention() rejects a call that differs, naming
    the argument, unless reuse_index=True is passed to apply the selection to other arrays of the same problem.

    Attributes:
        density: kept_blocks / visible_blocks (1.0 when nothing is visible); reading them on a device index
        synchronises its stream once.
        overflow_segments: segments of a device index that did not fit its block-id budget (build_index's
        max_kept_blocks) and run their full list, every block their tile sees (exact, at dense cost for those
        tiles; kept_blocks counts those full lists). Its to_host() copy lists them in full and keeps the count; 0
        for an index built on the CPU.
        block_size, group_size, num_kv_heads, num_subgroups, head_dim, correction, mode ('tile' or 'union'),
        on_device, binding.
        Host indexes also: segment_start, segment_end: [S] int32; block_ids: [N] int32; cu_blocks: [B+1] int32
        (block offsets); k_mean, v_mean: [total_blocks, num_kv_heads, D] float32 pooled block means (a tail block
        averages its valid keys), in the library of the inputs it was built from (numpy for to_host()); `host`
        holds them as a dict of numpy arrays. v_mean only with `correction` (its only reader): None otherwise, and
        the build then does not read V. For the means of V without an index, use pool_kv().
    """

    _ARRAYS = ("segment_start", "segment_end", "block_ids", "cu_blocks", "k_mean", "v_mean")

    def __init__(self, d: dict, lib: ArrayLib, cu_seqlens_q: Any, mode: str):
        """A host index from the dict the extension returns."""
        self._init_common(d["binding"], lib, cu_seqlens_q, mode, int(d["block_size"]), bool(d["correction"]),
                          int(d["num_subgroups"]))
        self.on_device = False
        self._counts = (int(d["kept_blocks"]), int(d["visible_blocks"]), int(d["overflow_segments"]))
        self.host = {name: d[name] for name in self._ARRAYS}  # v_mean None without the correction
        self._cache = {}
        for name in self._ARRAYS:  # in the inputs' library (zero copy on the CPU)
            setattr(self, name, _from_numpy(lib, self.host[name]))

    def _init_common(self, binding, lib, cu_seqlens_q, mode, block_size, correction, num_subgroups):
        self.binding = binding
        self.block_size = block_size
        self.correction = correction
        self.num_subgroups = num_subgroups
        self.num_kv_heads = _C.geometry.virtual_kv_heads(binding.num_kv_heads, num_subgroups)
        self.group_size = _C.geometry.virtual_group_size(binding.num_q_heads // binding.num_kv_heads, num_subgroups)
        self.head_dim = binding.head_dim
        self.mode = mode
        self._lib = lib
        self._cu_seqlens_q = cu_seqlens_q  # read lazily (may be a device array)
        self._tiles = None

    @classmethod
    def _device(cls, device_index: Any, workspace: Any, lib: ArrayLib, cu_seqlens_q: Any, mode: str) -> "Index":
        """A device index from the extension's DeviceIndex (which holds the workspace, selection, binding and
        stream of the build); `workspace` is the same array in q's library."""
        self = cls.__new__(cls)
        sel = device_index.selection
        self._init_common(device_index.binding, lib, cu_seqlens_q, mode, sel.block_size, sel.correction,
                          device_index.binding.num_subgroups)
        self.on_device = True
        self.workspace = workspace
        self._dev = device_index
        self._counts = None
        return self

    def __getattr__(self, name: str):
        # only reached for attributes that are not set: the host arrays of a device index
        if name in Index._ARRAYS or name == "host":
            raise AttributeError(f"{name}: this index lives on the device; call index.to_host() for its arrays")
        raise AttributeError(name)

    def to_host(self) -> "Index":
        """A host copy of this index (numpy arrays). Synchronises the stream the index was built on."""
        if not self.on_device:
            return self
        return Index(self._dev.to_host(), ArrayLib("numpy", np.zeros(0)), self._cu_seqlens_q, self.mode)

    # -- geometry ---------------------------------------------------------------------------------------------------
    def _read_counts(self) -> tuple:
        if self._counts is None:
            s = self._dev.stats()
            self._counts = (int(s.kept_blocks), int(s.visible_blocks), int(s.overflow_segments))
        return self._counts

    @property
    def kept_blocks(self) -> int:
        return self._read_counts()[0]

    @property
    def visible_blocks(self) -> int:
        return self._read_counts()[1]

    @property
    def overflow_segments(self) -> int:
        return self._read_counts()[2]

    @property
    def density(self) -> float:
        kept, visible, _ = self._read_counts()
        return kept / visible if visible else 1.0

    @property
    def batch(self) -> int:
        return int(self.binding.batch)

    @property
    def num_segments(self) -> int:
        return int(self.tiles.sum()) * self.num_kv_heads

    @property
    def tiles(self) -> np.ndarray:
        """[B] number of query tiles of each sequence: ceil(Lq_b * group_size / 128)."""
        if self._tiles is None:
            cu = to_numpy(self._cu_seqlens_q).astype(np.int64)
            self._tiles = np.asarray(_C.geometry.num_tiles(np.diff(cu).tolist(), self.group_size), dtype=np.int64)
        return self._tiles

    @property
    def segment_offsets(self) -> np.ndarray:
        """[B+1] first segment id of each sequence."""
        return np.concatenate([[0], np.cumsum(self.tiles * self.num_kv_heads)]).astype(np.int64)

    def segment_id(self, b: int, kv_head: int, tile: int) -> int:
        """The id of segment (b, kv_head, tile): segment_offsets[b] + kv_head * tiles[b] + tile.

        Args:
            b: sequence, in [0, B).
            kv_head: KV head (a virtual one with num_subgroups > 1), in [0, num_kv_heads).
            tile: query tile of sequence b, in [0, tiles[b]).
        """
        b, kv_head, tile = (_as_int(n, x) for n, x in (("b", b), ("kv_head", kv_head), ("tile", tile)))
        tiles = self.tiles
        if not 0 <= b < len(tiles):
            raise ValueError(f"b: sequence {b} out of range [0, {len(tiles)})")
        if not 0 <= kv_head < self.num_kv_heads:
            raise ValueError(f"kv_head: {kv_head} out of range [0, {self.num_kv_heads})")
        if not 0 <= tile < tiles[b]:
            raise ValueError(f"tile: {tile} out of range [0, {int(tiles[b])}) for sequence {b}")
        return int(self.segment_offsets[b] + kv_head * tiles[b] + tile)

    def segment(self, b: int, kv_head: int, tile: int) -> np.ndarray:
        """The kept block ids (ascending, per-sequence numbering) of one segment; a host index only (to_host() first).

        Args:
            b, kv_head, tile: the segment, as in segment_id().
        """
        s = self.segment_id(b, kv_head, tile)
        h = self.host
        lo, hi = int(h["segment_start"][s]), int(h["segment_end"][s])
        return h["block_ids"][lo:hi].copy()

    def __repr__(self) -> str:
        where = "device" if self.on_device else f"host, density={self.density:.4f}"   # no sync on the host
        return (f"Index(mode={self.mode!r}, on the {where}, block_size={self.block_size}, "
                f"group_size={self.group_size}, num_kv_heads={self.num_kv_heads}, "
                f"num_subgroups={self.num_subgroups}, correction={self.correction})")

    # -- placement --------------------------------------------------------------------------------------------------
    def _arrays_for(self, lib: ArrayLib) -> tuple:
        """The host index arrays in the compute library and on the device of `lib` (copied once, then cached)."""
        if not lib.cuda and lib.compute == self._lib.compute:
            return tuple(getattr(self, n) for n in self._ARRAYS)
        key = (lib.compute, lib.cuda, lib.device_id if lib.cuda else 0,
               str(getattr(lib.ref, "device", "")) if lib.compute == "torch" else "")
        if key not in self._cache:
            self._cache[key] = tuple(_from_numpy(lib, self.host[n]) for n in self._ARRAYS)
        return self._cache[key]

    def _arrays(self, lib: ArrayLib) -> Any:
        """The extension's IndexArrays of this host index for a call in `lib` (made per call: the attributes are
        the caller's to change; the device copies of the arrays are cached)."""
        arrays = dict(zip(self._ARRAYS, self._arrays_for(lib)))
        return _C.IndexArrays(block_size=self.block_size, correction=self.correction,
                              num_subgroups=self.num_subgroups, binding=self.binding, **arrays)

    def _host_index(self) -> Any:
        """The extension's HostIndex of this host index (union_index's input)."""
        return _C.HostIndex(block_size=self.block_size, group_size=self.group_size, num_kv_heads=self.num_kv_heads,
                            num_subgroups=self.num_subgroups, correction=self.correction,
                            kept_blocks=self.kept_blocks, visible_blocks=self.visible_blocks, binding=self.binding,
                            **self.host)


def _from_numpy(lib: ArrayLib, a: Optional[np.ndarray]) -> Any:
    """lib.from_numpy, passing None (an absent v_mean) through."""
    return None if a is None else lib.from_numpy(a)


@selection_keywords
def build_index(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                softmax_scale: Optional[float] = None, block_table=None, seqused_k=None, stream=None, workspace=None,
                mean_cache=None, options: Optional[LaunchOptions] = None, q_descale=None, k_descale=None,
                v_descale=None, qkv_dtype=None, selection: Optional[Selection] = None,
                **selection_keywords) -> Index:
    """The block selection: pooled block means, per-row scores, a threshold per tile, CSR index.

    Every packed row r of a (sequence, KV head, 128-row PackGQA query tile) scores each key block J it sees as
    s_rJ = scale * q_r . kmean_J; the selection `rule` thresholds these scores per tile (see "Selection arguments").
    alpha=0 keeps every visible block (sparse_attention then equals attention).

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, block_table,
            seqused_k, stream, options, q_descale, k_descale, v_descale, qkv_dtype: as in attention() (contiguous KV,
            or paged with block_table / seqused_k and cu_seqlens_k=None; FP8 with the descales, or as uint8 bit
            patterns with qkv_dtype='float8_e4m3fn'). attention()'s `window` mask does not apply here.
        selection: a Selection (sp.Selection(...)), the selection as one value; default: the one the keywords build.
        the selection keywords (one per field of sp.Selection; the signature lists them): see "Selection
            arguments" below; default: the library default (shown as <library default>).
        workspace: CUDA inputs only: a 1-D array of q's library on q's device of at least index_workspace_bytes(...)
            bytes, 256-byte aligned, in which the index lives (the call then allocates nothing and can be captured in
            a CUDA graph; the index lives there until the buffer is reused). Default: a workspace array allocated in
            q's library.
        mean_cache: paged KV on CUDA: the pooled-means cache of mean_cache(), as for chunked_prefill().

    Selection arguments. The one place they are documented: sparse_prefill(), chunked_prefill(), the
    *_workspace_bytes() functions, torch.ops.sparse_prefill.* and the engine adapters take the same ones, and so do
    sp.Selection's fields. The defaults written here are sp.SELECTION_DEFAULTS, read from the C++ SelectionParams{}
    (tests/python/test_docs.py checks that the two agree); the signatures show them as <library default>, so that a
    keyword passed is told from one left out. Pass the selection either as `selection=` or as the selection keywords
    (a keyword left out is the library default, sp.SELECTION_DEFAULTS), never both: any selection keyword passed
    together with `selection=` is a ValueError naming the keyword, whatever its value (the default's value too).
        alpha (default 0.003): the threshold of the rule, in [0, 1]; 0 keeps every visible block.
        rule (default 'row_max'): how the scores are thresholded:
            'row_max': with m_r = max_J s_rJ over the blocks row r sees, keep J iff max over the rows r that see J
                of (s_rJ - m_r) >= ln(alpha), i.e. J scores within a factor alpha of the top block of at least one
                row;
            'tile_energy' (FlashPrefill V2): keep J iff E_IJ = sum_r exp(s_rJ - M_I) >= alpha * max_J E_IJ, M_I the
                tile's maximum score. On a real LM (SmolLM2-135M) it loses far more accuracy than 'row_max'
                (docs/design/selection.md): a block that only a few rows need drowns in the tile-wide sum;
            'probe_row_max': the 'row_max' test on the exact softmax log-mass of each block for the probe rows
                (every 8th query of the sequence and its last one, all heads), plus the pooled-means 'row_max' test
                at `mean_alpha` for the other rows (SelectionRule::kProbeRowMax, docs/semantics.md). Sees the one
                strong key of a block that pooled means dilute 128x. On CUDA its probe pass costs ~1/8 of dense
                attention's QK^T, twice, on tensor cores (docs/design/index_stage.md);
            'probe_row_mass': 'probe_row_max' with the probe rows' test against the row's whole mass: J passes iff
                it holds at least alpha of a probe row's softmax probability (alpha ~0.05), so a diffuse row keeps
                none of its many equal blocks (SelectionRule::kProbeRowMass; accuracy and cost:
                docs/design/selection.md, docs/design/index_stage.md);
            'key_max': per-key block maxima on a low-rank residual: row r scores J by q_r . kmean_J plus the
                largest (P^T q_r) . (P^T (k_j - kmean_J)) over the keys j of J it sees, P the top `key_rank`
                directions of the key residuals of each (sequence, KV head), computed from the prompt's keys; one
                pass from the diagonal down keeps J iff scale * (score - m) >= ln(alpha), m the largest of the row's
                pooled-means bound, its exact maximum over the sink blocks' keys and the running maximum
                (SelectionRule::kKeyMax, docs/semantics.md, docs/design/key_max_spec.md). A block of alike keys
                scores as its mean, one strong key as itself.
            'exact_max': two stages: the blocks 'row_max' keeps at `candidate_alpha` over the pooled means (and the
                always-kept ones) are the candidates; row r scores a candidate by its exact maximum of q_r . k_j over
                the block's keys it sees, and one pass over the candidates from the diagonal down keeps J iff
                scale * (score - m) >= ln(alpha), m the larger of 'key_max''s bound and the running maximum
                (SelectionRule::kExactMax, docs/design/exact_max_spec.md; on CUDA arrays src/cuda/index/exact_max.cu,
                exact block maxima on tensor cores over the candidates alone).
        mean_alpha (default 0.5): the pooled-means threshold of the non-probe rows under the probe rules (ignored
            by the other rules).
        key_rank (default 16): the rank of 'key_max''s residual basis, 16 or 32 (at most the head dim; ignored by
            the other rules, validated all the same).
        candidate_alpha (default 0.003): the 'row_max' threshold over the pooled means that proposes 'exact_max''s
            candidates, in [0, 1] (ignored by the other rules).
        block_size (default 128): key block size in tokens, a positive multiple of 64 (CUDA sparse attention:
            a multiple of 128).
        sink (default 256): the blocks of the first `sink` tokens are always kept.
        window (default 512): the blocks meeting the `window` tokens before each query are always kept (an int, the
            selection's local window; not attention()'s (left, right) mask).
        last_n (default 2): every visible block is kept for the last `last_n` query tiles of each sequence (they
            run dense); only in a final chunk, see final_chunk.
        correction (default False): recorded in the index: sparse_attention then adds, for every dropped block fully
            visible to the whole tile, one virtual key kmean_J with value vmean_J and weight |B_J|; only then does
            the index hold v_mean (else None: V is not pooled). It halves the error on the structured workload but
            changed nothing measurable on SmolLM2 (the mean logit underestimates a peaked block's mass) and costs
            +30 % (32K) to +66 % (128K) of the sparse attention time on the H200 (docs/design/sparse_kernel.md).
        head_subgroups (default 0): S, dividing g = Hq // Hkv: splits each GQA group into S sub-groups of g // S
            query heads, each selected on its own, as if the model had Hkv * S KV heads (virtual KV head v holds
            query heads [v * g // S, (v + 1) * g // S) and reads K/V head v // S; the index's num_kv_heads,
            group_size, segments and means are over these virtual heads). In union mode the union is then per
            sub-group rather than over the whole group. 0 means S = g, one selection per query head (the index then
            reports num_subgroups = g); 1 is one selection per KV group.
        dense_fraction (default 0.85): the dense rule, in (0, 1]: a call whose selection keeps at least this fraction
            of its visible blocks keeps them all (density 1, every segment its full list): near full density the
            sparse kernel costs what dense attention costs, so the last few percent are not worth pruning. On CUDA
            a one-shot launch over such an index then runs the dense kernel, decided on the device. 1 turns the
            rule off.
        final_chunk (default True; chunked_prefill() requires it): chunked prefill (queries = the last C positions of
            each sequence, k/v = its whole cache): False for a chunk that does not end its prompt (the last_n dense
            tail tiles are for the prompt's final queries only).
        union (default False): one list per (sequence, KV head), the union of its tiles' lists (CompactAttention;
            the index's mode 'union'), built in the same call; else per-tile lists (FlashPrefill V2).
        max_kept_blocks (default None; CUDA; None or an int in [0, 2^31 - 1]): the device index's budget of block
            ids, 4 bytes each in the workspace. None: the causal bound, room for any selection (each segment at most
            the blocks its tile's last row sees; 67 MB at 128K with Hq 32, Hkv 8, 4.3 GB at 1M). A budget makes the
            workspace follow the kept blocks (e.g. a few times the density you run at times the causal bound):
            segments take their ids in the order their CTAs finish, and one that no longer fits runs its full list
            (every block its tile sees: the output stays exact, that tile runs at dense cost), counted by
            index.overflow_segments. In union mode the per-tile lists and the unions share the budget. Ignored by the
            CPU reference (validated all the same); pass the same value to the *_workspace_bytes() functions.

    Returns:
        Index (see its docstring); `index.density` is kept / visible blocks. CPU inputs give a host index; CUDA inputs
        an index that stays on the device (Index.on_device; index.to_host() copies it).
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream, options)
    sel = _selection(selection, selection_keywords)
    mode = "union" if sel.union else "tile"
    mean_k, mean_v, mean_bs = _mean_cache_arrays(mean_cache, call)
    if not call.lib.cuda:
        if mean_cache is not None:
            raise ValueError("mean_cache: build_index() takes a mean cache on CUDA only (the CPU reference pools "
                             "every block)")
        return Index(_C.build_index(inputs, sel._params), call.lib, call.arrays["cu_seqlens_q"], mode)
    ws = call.workspace(workspace)
    if ws is None:
        ws = call.lib.empty((max(int(_C.index_workspace_bytes(inputs, sel._params)), 1),), "uint8")
    dev = _C.build_index_device(inputs, sel._params, call.c(ws), mean_k=call.c(mean_k), mean_v=call.c(mean_v),
                                mean_block_size=mean_bs)
    return Index._device(dev, ws, call.lib, call.arrays["cu_seqlens_q"], mode)


@selection_keywords
def index_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, block_table=None,
                          seqused_k=None, causal: bool = True, softmax_scale: Optional[float] = None,
                          options: Optional[LaunchOptions] = None, qkv_dtype=None,
                          selection: Optional[Selection] = None, **selection_keywords) -> int:
    """Bytes of the `workspace` of build_index() on these arrays (read for their shapes only: no device access);
    0 for CPU arrays.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, causal,
            softmax_scale, options, qkv_dtype: as in build_index() (shapes are read, not values).
        selection, or the selection keywords: the selection of the build (see build_index(), "Selection arguments";
            default: the library default), not both; those that do not change the size (block_size, union,
            head_subgroups and max_kept_blocks do) may be left out.
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k), qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), 0, options)
    sel = _selection(selection, selection_keywords)
    return int(_C.index_workspace_bytes(inputs, sel._params))


@selection_keywords
def sparse_prefill_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                                   block_table=None, seqused_k=None, causal: bool = True,
                                   softmax_scale: Optional[float] = None, options: Optional[LaunchOptions] = None,
                                   qkv_dtype=None, selection: Optional[Selection] = None,
                                   **selection_keywords) -> int:
    """Bytes of the `workspace` of sparse_prefill() (the index and its launch state); 0 for CPU arrays.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, causal,
            softmax_scale, options, qkv_dtype, selection: as in index_workspace_bytes(), with sparse_prefill()'s
            arrays; the selection keywords: see build_index(), "Selection arguments".
    """
    return index_workspace_bytes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 block_table=block_table, seqused_k=seqused_k, causal=causal,
                                 softmax_scale=softmax_scale, options=options, qkv_dtype=qkv_dtype,
                                 selection=selection, **selection_keywords)


@selection_keywords
def chunked_prefill_workspace_bytes(q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q: int,
                                    max_seqlen_k: int, options: Optional[LaunchOptions] = None, qkv_dtype=None,
                                    selection: Optional[Selection] = None, **selection_keywords) -> int:
    """Bytes of the `workspace` of chunked_prefill(); 0 for CPU arrays.

    Args:
        q, k_cache, v_cache, cu_seqlens_q, block_table, seqused_k, max_seqlen_q, max_seqlen_k, options, qkv_dtype,
            selection: as in index_workspace_bytes(), with chunked_prefill()'s arrays; the selection keywords: see
            build_index(), "Selection arguments".
    """
    return index_workspace_bytes(q, k_cache, v_cache, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k,
                                 block_table=block_table, seqused_k=seqused_k, options=options, qkv_dtype=qkv_dtype,
                                 selection=selection, **selection_keywords)


@selection_keywords
def sparse_support(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, block_table=None,
                   seqused_k=None, causal: bool = True, softmax_scale: Optional[float] = None, q_descale=None,
                   k_descale=None, v_descale=None, qkv_dtype=None, selection: Optional[Selection] = None,
                   **selection_keywords) -> Optional[str]:
    """Why sparse_prefill() / chunked_prefill() would not run block-sparse on these arrays and their device: None when
    it would, else the reason in the backend's own words (the NotImplementedError message the call would raise:
    what the device's kernels are not built for, e.g. a head dim, a page size, an attention window, a build without
    CUDA). The one answer to "why not sparse?": the engine adapters ask it instead of restating the rules. CPU arrays:
    always None (the CPU reference computes every valid call). Bad arguments raise as the call does.

    Args:
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table, seqused_k, causal,
            softmax_scale, q_descale, k_descale, v_descale, qkv_dtype: as in sparse_prefill() (paged KV: chunked
            prefill's arrays, cu_seqlens_k=None); shapes, dtypes, strides and base addresses are read, never values.
        selection, or the selection keywords: the call's selection (see build_index(), "Selection arguments").
    """
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                            (q_descale, k_descale, v_descale)), qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), 0, None)
    reason = _C.sparse_prefill_support(inputs, _selection(selection, selection_keywords)._params)
    return reason or None


def union_index(index: Index, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                causal: bool = True, softmax_scale: Optional[float] = None, block_table=None, seqused_k=None,
                stream=None, qkv_dtype=None) -> Index:
    """Chunked-prefill lowering: one ascending block list per (sequence, KV head), the union of the lists of all
    its tiles (always-kept blocks included); every tile's segment points at the shared list (mode 'union'). With
    index.num_subgroups > 1 the KV heads are the index's virtual heads: one list per sub-group. Computed on the host
    from CPU arrays (CUDA arrays raise NotImplementedError: build_index(..., union=True) builds the union on the GPU).

    Args:
        index: an Index from build_index() in tile mode.
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, block_table,
            seqused_k, stream, qkv_dtype: the inputs `index` was built from, as in build_index() (the shapes and
            lengths lay the segments out).

    Returns:
        a host Index in mode 'union'.
    """
    if not isinstance(index, Index):
        raise TypeError(f"index: expected a sparse_prefill.Index, got {type(index).__name__}")
    index = index.to_host()
    call = _Call(_kv_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k), qkv_dtype=qkv_dtype)
    inputs = call.inputs(max_seqlen_q, max_seqlen_k, causal, softmax_scale, (-1, -1), stream)
    d = _C.union_index(inputs, index._host_index())
    return Index(d, call.lib, call.arrays["cu_seqlens_q"], "union")


def pool_kv(k, v, cu_seqlens_k, block_size: int = 128, max_seqlen_k: Optional[int] = None, block_table=None,
            seqused_k=None, stream=None, qkv_dtype=None):
    """Pooled block means of K and V: block J of sequence b averages its keys (a tail block its valid keys).

    Args:
        k, v: contiguous [total_k, Hkv, D] (with cu_seqlens_k) or paged [num_pages, page_size, Hkv, D] (with
            block_table and seqused_k, cu_seqlens_k=None).
        cu_seqlens_k: [B+1] int32 offsets (contiguous KV), else None.
        block_size: tokens per block (default 128).
        max_seqlen_k: bound on the key lengths; default the longest sequence (read on the host).
        block_table, seqused_k: paged KV, as in attention().
        stream: as in attention().
        qkv_dtype: as in attention() (uint8 k, v of float8_e4m3fn bit patterns).

    Returns:
        (k_mean, v_mean, cu_blocks): [total_blocks, Hkv, D] float32 twice and [B+1] int32 block offsets, in k's
        array library and device. Both means always (this helper has no correction setting; an Index's v_mean is
        there only with the correction).
    """
    block_size = _as_int32("block_size", block_size)
    call = _Call({"k": k, "v": v, "cu_seqlens_k": cu_seqlens_k, "block_table": block_table,
                  "seqused_k": seqused_k}, ref="k", qkv_dtype=qkv_dtype)
    a = call.arrays
    paged = block_table is not None
    kv_rank = 4 if paged else 3
    if len(a["k"].shape) != kv_rank:
        raise ValueError(f"k: expected a {kv_rank}-dimensional array "
                         f"{'[num_pages, page_size, Hkv, D]' if paged else '[total_k, Hkv, D]'}, got shape "
                         f"{tuple(a['k'].shape)}")
    if paged:
        bt = a["block_table"]
        if len(bt.shape) != 2 or bt.shape[0] < 1:
            raise ValueError(f"block_table: expected a 2-dimensional array [B, max_pages] with B >= 1, got shape "
                             f"{tuple(bt.shape)}")
        batch = int(bt.shape[0])
    else:
        cu = a["cu_seqlens_k"]
        if cu is None:
            raise ValueError("cu_seqlens_k: is required with contiguous KV (or pass block_table and seqused_k)")
        if len(cu.shape) != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens_k: expected a 1-dimensional array of B+1 >= 2 entries, got shape "
                             f"{tuple(cu.shape)}")
        batch = int(cu.shape[0]) - 1
    if max_seqlen_k is None:
        if paged:
            used = to_numpy(a["seqused_k"]) if a["seqused_k"] is not None else np.zeros(0)
            max_seqlen_k = int(used.max()) if used.size else 0
        else:
            max_seqlen_k = int(np.diff(to_numpy(a["cu_seqlens_k"]).astype(np.int64)).max())
    # The C++ entry point takes full attention inputs; q is a zero-row stand-in (group size 1) used for shapes only.
    kw = a["k"]
    a["q"] = call.lib.empty((0, kw.shape[-2], kw.shape[-1]), kw.dtype)
    a["cu_seqlens_q"] = call.lib.zeros((batch + 1,), "int32")
    inputs = call.inputs(0, max_seqlen_k, True, None, (-1, -1), stream)
    try:
        d = _C.pool_kv(inputs, block_size)
    except (ValueError, TypeError) as e:
        if getattr(e, "argument", None) != "q":
            raise
        # the stand-in q mirrors k's head count and head dim: report its problems against k
        err = type(e)("k" + str(e)[1:])
        err.argument = "k"
        raise err from None
    return tuple(call.lib.wrap_out(call.lib.from_numpy(d[n])) for n in ("k_mean", "v_mean", "cu_blocks"))

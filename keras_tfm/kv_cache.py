"""Key/value caches of cached decoding: their two forms, and the folding of a query's rows onto a
context cache of fewer rows (beam search's beams sharing their source's row).

A self-attention cache is a `(keys, values)` pair of `(B, H, L, d)` arrays, heads first (what
`MultiHeadSelfAttention.empty_cache` makes); `CrossAttention.compute_context_cache` gives one
stacked `(B, 2, H, S, d)` array.
"""

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._backend import stacks_caches


def cache_keys_values(cache):
    """The keys and values `(B, H, L, d)` of a key/value cache: a stacked `(B, 2, H, L, d)`
    array (`CrossAttention.compute_context_cache`'s), or its `(keys, values)` pair (what
    `MultiHeadSelfAttention.empty_cache` makes and generation passes: under XLA a slice of the
    stacked array is a copy, which a decoding loop would make in every layer at every step)."""
    if isinstance(cache, (tuple, list)):
        keys, values = cache
        return keys, values
    return cache[:, 0], cache[:, 1]


def search_cache(attention, rows, length, dtype=None):
    """`attention.empty_cache(rows, length, dtype)` in the form a search of `rows` rows holds
    it: the `(keys, values)` pair, or stacked `(rows, 2, H, L, d)` where `stacks_caches(rows)`."""
    cache = attention.empty_cache(rows, length, dtype)
    return ops.stack(cache, 1) if stacks_caches(rows) else cache


def cache_spec(cache):
    """`KerasTensor`s of a cache's shapes and dtype, in its form (array or pair)."""
    if isinstance(cache, (tuple, list)):
        return tuple(keras.KerasTensor(part.shape, dtype=part.dtype) for part in cache)
    return keras.KerasTensor(cache.shape, dtype=cache.dtype)


def fold_query_rows(query, keys, attention_mask=None):
    """`query (R, T, D)` (and an `attention_mask` `(R, T, S)` or `(T, S)`) folded for a
    context cache of fewer rows, `keys (B, H, S, d)` with `R = m·B`: `(B, m·T, D)` (and
    `(B, m·T, S)`), query rows `b·m … b·m + m - 1` as the query positions of cache row `b`.

    Each query position attends to the keys on its own, so the fold changes no number; it lets
    beam search keep one cross-attention cache row per source for its `m` beams (instead of
    repeating each `m` times: `m` times the memory, read at every step). With `R = B` it
    changes nothing (shapes known at run time only are folded the same way)."""
    rows, sources = query.shape[0], keys.shape[0]
    if rows is not None and sources is not None and (rows % sources if sources else rows):
        raise ValueError(f"A context cache of {sources} rows serves a query of a multiple of "
                         f"{sources} rows; received {rows} query rows.")
    if attention_mask is None and rows is not None and rows == sources:
        return query, None  # (nothing to fold)
    sources = ops.shape(keys)[0]
    if attention_mask is not None:  # (its shape checked as the query's, before the fold)
        attention_mask = masks_lib.check_attention_mask(attention_mask, query, keys[:, 0])
        attention_mask = ops.reshape(
            ops.broadcast_to(attention_mask, ops.shape(query)[:2] + ops.shape(keys)[2:3]),
            (sources, -1, ops.shape(keys)[2]))
    return ops.reshape(query, (sources, -1, query.shape[2])), attention_mask


def unfold_query_rows(output, query):
    """The output `(B, m·T, D')` of a folded query (`fold_query_rows`) as `(R, T, D')`."""
    if output.shape[0] is not None and output.shape[0] == query.shape[0]:
        return output  # (not folded)
    return ops.reshape(output, ops.shape(query)[:2] + (output.shape[-1],))


def heads_first(x):
    """Keys or values `(B, S, H, d)` as a cache holds them, `(B, H, S, d)`; stacked ones
    `(B, 2, S, H, d)` as `(B, 2, H, S, d)`."""
    return ops.swapaxes(x, -3, -2)

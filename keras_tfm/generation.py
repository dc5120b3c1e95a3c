"""Generation with a key/value cache: greedy search, beam search and sampling, for translation
(encoder-decoder) and for language models (decoder-only).

Training sees the whole target at once (masked attention, seed 000); inference generates one
token at a time and feeds it back. Recomputing the decoder over the whole prefix at every step
makes decoding quadratic; here each decoder block keeps a preallocated key/value cache of its
self-attention, the cross-attention keys and values are computed once per source batch (a
language model's prompt is prefilled in one pass), and each step runs the decoder on one new
token only. This module checks the arguments, picks the search (`keras_tfm.search`) and runs
it in chunks; the models' `call_with_cache` is the step. Layout: docs/design.md.
"""

import keras
import numpy as np
from keras import ops

from keras_tfm import search as search_lib
from keras_tfm._backend import transposed_table
from keras_tfm._checks import (check_lengths, check_real_tokens, check_search_options,
                               check_sources, resolve_special_ids, unpadded_prompts)
from keras_tfm.models import LanguageModel
from keras_tfm.seq2seq import Seq2SeqParts

PAD_ID = 0  # the default padding id, for models that do not name their own
AUTO = "auto"  # a special id taken from the model (`model.special_ids`)
__all__ = ["generate", "generate_language_model", "Seq2SeqParts"]


_POWERS_OF_TWO = [2 ** n for n in range(3, 31)]  # "auto" length buckets: 8, 16, 32, 64, …
_FINE_BUCKETS = sorted(_POWERS_OF_TWO + [3 * b // 2 for b in _POWERS_OF_TWO])  # 8, 12, 16, 24, …
_FINE_BUCKET_ROWS = 16  # "auto" takes `_FINE_BUCKETS` for searches of at least this many rows


def _bucket_sources(source_tokens, length_buckets, pad_id, encoder_embedding, rows):
    """The sources right-padded with `pad_id` to the smallest bucket that holds them (masked:
    the tokens cannot change), so a search compiled per shape compiles once per bucket. "auto"
    pads where a search of `rows` rows compiles per shape (`search.compiles_per_shape`): powers
    of two from 8, from `_FINE_BUCKET_ROWS` rows also their halfway points (less padding for the
    encoder). No bucket exceeds a learned position table; a longer source stays as it is."""
    auto = isinstance(length_buckets, str) and length_buckets == AUTO
    if not auto and length_buckets is not None and not (
            isinstance(length_buckets, (list, tuple)) and length_buckets
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                    for b in length_buckets)
            and list(length_buckets) == sorted(set(length_buckets))):
        raise ValueError('`length_buckets` must be "auto", None or an increasing sequence of '
                         f"positive ints; received length_buckets={length_buckets!r}.")
    if auto and search_lib.compiles_per_shape(rows):
        length_buckets = _FINE_BUCKETS if rows >= _FINE_BUCKET_ROWS else _POWERS_OF_TWO
    elif auto or length_buckets is None:
        return source_tokens
    width = source_tokens.shape[1]
    limit = encoder_embedding.max_length if encoder_embedding.positional == "learned" else None
    fits = [b for b in length_buckets if b >= width and (limit is None or b <= limit)]
    if not fits:
        return source_tokens
    return np.pad(source_tokens, ((0, 0), (0, min(fits) - width)), constant_values=pad_id)


def generate(model, source_tokens, start_id=AUTO, end_id=AUTO, max_length=None, method="greedy",
             beam_size=4, length_penalty=0.6, return_scores=False, batch_size=None,
             verbose=False, pad_id=AUTO, temperature=1.0, top_k=None, top_p=1.0, seed=None,
             length_buckets=AUTO):
    """Translate source token ids, or continue prompts, with a key/value-cached greedy search,
    beam search or sampling.

    Works on models from `build_transformer` and `from_marian`, and on models built by hand from
    the keras_tfm blocks as in docs/design.md (see `Seq2SeqParts` for how the layers are found);
    and on language models from `build_language_model` (then `source_tokens` are the prompts,
    and the result holds the new tokens only; see
    `keras_tfm.generation.generate_language_model`).

    Args:
        model: the encoder-decoder `keras.Model`, or a `LanguageModel`.
        source_tokens: int `(B, S)`, right-padded with the padding id; a list of sequences of
            different lengths is right-padded for you. Checked before anything runs: ids in
            the source vocabulary (`check_token_ids`), no padding before a real token.
        start_id: the `<SOS>` id fed first to the decoder; "auto" takes the model's own
            (`model.special_ids`).
        end_id: the `<EOS>` id; a sequence stops once it produced it. "auto" takes the model's
            own; None never stops (exactly `max_length` tokens, as benchmarks need). It must
            differ from the padding id.
        max_length: at most this many new tokens (`<EOS>` included); with learned positions,
            at most the decoder's `max_length`.
        method: `"greedy"`, `"beam"` or `"sample"` (a draw from the softmax of
            `logits / temperature`, restricted to `top_k` and `top_p`, at every step).
        beam_size: beams per source for beam search; `beam_size=1` runs greedy search.
            `2 * beam_size` must not exceed the number of non-padding target tokens.
        length_penalty: α ≥ 0 of the penalty `((5 + len) / 6)^α` that beam search divides the
            log-probability by to rank hypotheses (0.6 in the paper's decoding).
        return_scores: also return each sequence's log-probability (the sum of its tokens'
            log-probabilities, `<EOS>` included; not length-penalised).
        batch_size: decode the sources in chunks of this size (None: all at once). Under
            PyTorch and TensorFlow's graph (no compile per shape) the chunks take the shortest
            sources first, each cut to its longest source; results keep the order given.
        verbose: show a progress bar over the chunks.
        pad_id: the padding id of the sources and of the output; never generated. "auto" takes
            the model's own (0 for a model without one).
        temperature: > 0, divides the logits before sampling.
        top_k: None, or sample among the `top_k` most likely tokens only.
        top_p: in (0, 1]: sample in the nucleus, the smallest set of most likely tokens whose
            probability (after `top_k`) reaches `top_p`; 1 keeps every token.
        seed: int seed of the draws (NumPy uniforms passed to the compiled search: the same
            seed gives the same tokens on every call); None draws a fresh seed.
        length_buckets: source lengths the sources are right-padded up to (the smallest that
            holds them), so that a search compiled per shape compiles once per bucket rather
            than once per source length; the padding is masked and cannot change the tokens.
            "auto": 8, 16, 32, 64, ... (from 16 rows a chunk, sources × beams, also 12, 24,
            48, ...) under JAX, and under TensorFlow when a chunk has 17 rows or more
            (TensorFlow compiles those with XLA); otherwise none (TensorFlow's one graph of
            unknown lengths serves all; PyTorch is eager); None: no padding; or an
            increasing sequence of positive ints.

    Returns:
        NumPy int32 tokens `(B, L)` with `L ≤ max_length` (the longest sequence; no `<SOS>`,
        `<EOS>` kept, padding after it), and with `return_scores` the float32
        log-probabilities `(B,)` (under the model's distribution, also when sampling).

    Example:

    >>> tokens = generate(model, source, start_id=1, end_id=2, max_length=30)  # doctest: +SKIP
    """
    strategy = _strategy(method, beam_size, length_penalty, temperature, top_k, top_p)
    check_lengths(max_length, batch_size)
    if isinstance(model, LanguageModel):
        return generate_language_model(model, source_tokens, max_length, end_id=end_id,
                                       pad_id=pad_id, start_id=start_id, method=method,
                                       return_scores=return_scores, batch_size=batch_size,
                                       verbose=verbose, seed=seed, temperature=temperature,
                                       top_k=top_k, top_p=top_p)
    parts = Seq2SeqParts.from_model(model)
    decoder = model if hasattr(model, "call_with_cache") else parts  # (a model built by hand)
    vocab = parts.target_vocab_size
    start_id, end_id, pad_id = resolve_special_ids(model, vocab, start_id, end_id, pad_id)
    embedding = parts.decoder_embedding
    if embedding.positional == "learned" and max_length > embedding.max_length:
        raise ValueError(
            f"`max_length`={max_length} exceeds the decoder's learned position table "
            f"(max_length={embedding.max_length}): step t is embedded at position t."
        )
    if isinstance(strategy, search_lib.Beam) and 2 * beam_size > vocab - 1:
        raise ValueError(
            f"`beam_size`={beam_size} is too large for a target vocabulary of {vocab}: beam "
            "search draws 2 * beam_size candidates among the non-padding tokens."
        )
    source_tokens = check_sources(source_tokens, parts.encoder_embedding.vocab_size, pad_id)
    check_real_tokens((source_tokens != pad_id).sum(axis=1), "source", pad_id)
    table = parts.encoder_embedding.max_length
    if parts.encoder_embedding.positional == "learned" and source_tokens.shape[1] > table:
        raise ValueError(f"Sources of length {source_tokens.shape[1]} exceed the encoder's "
                         f"learned position table (max_length={table}).")
    beams = strategy.beams
    rows = min(batch_size or len(source_tokens), len(source_tokens)) * beams
    source_tokens = _bucket_sources(source_tokens, length_buckets, pad_id,
                                    parts.encoder_embedding, rows)
    settings = search_lib.Settings(strategy, max_length, _end(end_id), pad_id,
                                   scored=return_scores)
    inputs = [source_tokens]
    if isinstance(strategy, search_lib.Sample):
        inputs.append(search_lib.uniforms(seed, len(source_tokens), max_length + 1))

    def run(source, uniforms=None, logits_table=None):
        cache = decoder.initial_cache(source, max_length, beams, pad_id)
        if logits_table is not None:
            cache = dict(cache, logits_table=logits_table)
        rows = ops.shape(source)[0] * beams
        prompts = ops.full((rows, 1), start_id, "int32")
        return search_lib.search(decoder, settings, cache, prompts, ops.ones((rows,), "int32"),
                                 uniforms)

    return _run_in_chunks(model, ("seq2seq", settings), run, inputs, batch_size, verbose,
                          pad_id, return_scores, beams=beams, sources=True,
                          table=parts.tied_table())


def _end(end_id):
    return search_lib.NO_END if end_id is None else end_id


def _strategy(method, beam_size, length_penalty, temperature, top_k, top_p):
    """The checked search strategy of `method` (one beam is greedy search)."""
    check_search_options(method, beam_size, length_penalty, temperature, top_k, top_p)
    if method == "sample":
        return search_lib.Sample(float(temperature), top_k, float(top_p))
    if method == "beam" and beam_size > 1:
        return search_lib.Beam(beam_size, float(length_penalty))
    return search_lib.Greedy()


def _run_in_chunks(model, key, function, inputs, batch_size, verbose, pad_id, return_scores,
                   static_shapes=False, beams=1, sources=False, table=None):
    """Run `function`, compiled once per `key` (`search.compiled`), on chunks of the NumPy
    `inputs` (`beams` beams a row); the tokens cut after the longest sequence, and the scores,
    in the order given. With `sources` (`inputs[0]`: right-padded sources) and shapes that
    cost no compile (PyTorch, TensorFlow's graph), chunks take the shortest sources first, each
    cut to its longest (the padding is masked: the tokens are those of any chunking). `table`:
    the model's tied logits table variable, passed transposed as `logits_table` where the
    search reads it so (`_backend.transposed_table`)."""
    run = search_lib.compiled(model, key, function, beams, static_shapes)
    chunk = batch_size or len(inputs[0])
    transposed = transposed_table(model, table, min(chunk, len(inputs[0])) * beams)
    constants = {} if transposed is None else {"logits_table": transposed}
    per_shape = search_lib.compiles_per_shape(chunk * beams, static_shapes)
    starts = range(0, len(inputs[0]), chunk)
    order = None
    if sources and len(starts) > 1 and not per_shape:
        lengths = (inputs[0] != pad_id).sum(axis=1)  # (no padding before a real token)
        order = np.argsort(lengths, kind="stable")
        inputs, lengths = [x[order] for x in inputs], lengths[order]
    progress = keras.utils.Progbar(len(starts)) if verbose else None
    all_tokens, all_scores = [], []
    for n, start in enumerate(starts):
        part = [x[start:start + chunk] for x in inputs]
        if order is not None:  # the chunk's sources cut to the longest of them
            part[0] = part[0][:, :max(int(lengths[start:start + chunk].max()), 1)]
        rows = len(part[0])
        if rows < chunk and n > 0 and per_shape:
            # A shorter last chunk would compile the search again: filled up with copies of
            # its first row, whose results are dropped (rows never interact).
            part = [np.concatenate([x, np.repeat(x[:1], chunk - rows, axis=0)]) for x in part]
        tokens, scores = run(*[ops.convert_to_tensor(x) for x in part], **constants)
        all_tokens.append(np.asarray(ops.convert_to_numpy(tokens))[:rows])
        all_scores.append(np.asarray(ops.convert_to_numpy(scores), "float32")[:rows])
        if progress is not None:
            progress.update(n + 1)
    tokens, scores = np.concatenate(all_tokens, axis=0), np.concatenate(all_scores, axis=0)
    if order is not None:  # back in the order given
        restore = np.argsort(order)
        tokens, scores = tokens[restore], scores[restore]
    if pad_id is not None:  # (None: a model without padding; every column is kept)
        longest = int((tokens != pad_id).sum(axis=1).max(initial=0))
        tokens = tokens[:, :max(longest, 1)]
    if return_scores:
        return tokens, scores
    return tokens


def generate_language_model(model, prompts, max_length, end_id=AUTO, pad_id=AUTO,
                            start_id=AUTO, method="greedy", return_scores=False,
                            batch_size=None, verbose=False, seed=None, temperature=1.0,
                            top_k=None, top_p=1.0):
    """Continue prompts with a `LanguageModel`; what `generate(lm, prompts, ...)` runs.

    The prompts are prefilled in one pass into each block's key/value cache, then each step
    feeds one token. Prompts of different lengths come right-padded; each row continues from
    its own last real token exactly as it would alone (positions and masks per row: every row
    steps through the same positions, keeping its prompt tokens while inside its prompt).

    Args:
        model: a `LanguageModel` (`build_language_model`).
        prompts: int `(B, P)`, right-padded with the padding id (or a list of sequences of
            different lengths); every prompt holds at least one real token.
        max_length: at most this many new tokens per row (`<EOS>` included); with learned
            positions, the prompt plus `max_length` must fit the table.
        end_id: a row stops once it produced it; "auto": the model's own; None: never.
        pad_id: the padding id of the prompts and the output; "auto": the model's own. A
            model without padding (`pad_id=None`) attends to every id: give prompts of
            different lengths as a list; the output keeps `max_length` columns, a row's
            positions after its `end_id` holding `end_id`.
        start_id: not used (a prompt holds its own start token); "auto" or None.
        method: `"greedy"` or `"sample"`.
        return_scores, batch_size, verbose, seed, temperature, top_k, top_p: as in `generate`.

    Returns:
        NumPy int32 new tokens `(B, L)`, `L ≤ max_length` (padding after `<EOS>`), and with
        `return_scores` their float32 log-probabilities `(B,)`.

    Example:

    >>> generate(lm, [[5, 9, 4], [7]], max_length=10, end_id=2)  # doctest: +SKIP
    """
    if method == "beam":
        raise ValueError('A language model decodes with method="greedy" or "sample"; received '
                         'method="beam".')
    strategy = _strategy(method, 1, 0.0, temperature, top_k, top_p)
    check_lengths(max_length, batch_size)
    vocab = model.get_layer("token_embedding").input_dim
    if pad_id == AUTO and "pad_id" not in model.special_ids:
        pad_id = None  # a model without padding (`pad_id=None`)
    _, end_id, pad_id = resolve_special_ids(model, vocab, start_id, end_id, pad_id,
                                             needs_start=False)
    suppress_pad = pad_id is not None
    if pad_id is None:  # every id is a token: lengths from the rows, rows filled by `fill`
        pad_id = PAD_ID if end_id is None else end_id
        prompts, lengths = unpadded_prompts(prompts, vocab, pad_id)
    else:
        prompts = check_sources(prompts, vocab, pad_id)
        lengths = (prompts != pad_id).sum(axis=1).astype("int32")
    check_real_tokens(lengths, "prompt", pad_id)
    prompts = prompts[:, :lengths.max()]
    table = model.get_config()["max_length"] if model.get_config()["positional"] == (
        "learned") else None
    if table is not None and prompts.shape[1] + max_length > table:
        raise ValueError(
            f"The longest prompt ({prompts.shape[1]} tokens) plus max_length={max_length} "
            f"exceeds the learned position table (max_length={table}) of model {model.name!r}.")
    settings = search_lib.Settings(strategy, max_length, _end(end_id), pad_id, suppress_pad,
                                   return_scores)
    inputs = [prompts, lengths]
    if isinstance(strategy, search_lib.Sample):
        inputs.append(search_lib.uniforms(seed, len(prompts), prompts.shape[1] + max_length))

    def run(prompts, lengths, uniforms=None, logits_table=None):
        cache = model.initial_cache(ops.shape(prompts)[0], prompts.shape[1] + max_length - 1)
        if logits_table is not None:
            cache = dict(cache, logits_table=logits_table)
        return search_lib.search(model, settings, cache, prompts, lengths, uniforms)

    # The caches hold prompt length + max_length - 1 positions: a static shape for TensorFlow.
    return _run_in_chunks(model, ("language_model", settings), run, inputs, batch_size, verbose,
                          None if not suppress_pad else pad_id, return_scores, static_shapes=True,
                          table=model.tied_table())

"""Generation with a key/value cache: greedy search, beam search and sampling, for translation
(encoder-decoder) and for language models (decoder-only).

Training sees the whole target at once (masked attention, seed 000); inference generates one
token at a time and feeds it back. Recomputing the decoder over the whole prefix at every step
makes decoding quadratic; here each decoder block keeps a preallocated key/value cache of its
self-attention, the cross-attention keys and values are computed once per source batch (a
language model's prompt is prefilled in one pass), and each step runs the decoder on one new
token only.
"""

import dataclasses
import weakref

import keras
import numpy as np
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._backend import (argmax, call_layer, compiler_options, direct_calls,
                                keep_freed_memory, reorder_beams, repeated_layer_caller,
                                slice_update, suppress_token, top_k, transposed_weight,
                                transposed_weights)
from keras_tfm._checks import check_special_ids, check_token_ids
from keras_tfm.attention import cache_keys_values
from keras_tfm.blocks import TransformerDecoderBlock, TransformerEncoderBlock
from keras_tfm.embedding import TokenAndPositionEmbedding
from keras_tfm.models import LanguageModel

PAD_ID = 0  # the default padding id, for models that do not name their own
AUTO = "auto"  # a special id taken from the model (`model.special_ids`)
_NO_END = -1  # `end_id=None`: an id that never comes, so decoding runs to max_length
_NEG_INF = -1e9  # finite: -inf - -inf would give NaN in the beam bookkeeping


@dataclasses.dataclass
class Seq2SeqParts:
    """The layers of an encoder-decoder model, found by type (and name where it matters).

    `from_model` looks in `model.layers` for:

    * two `TokenAndPositionEmbedding` layers: the ones named `encoder_embedding` and
      `decoder_embedding` if present, else the first is the encoder's and the second the
      decoder's; or one named `shared_embedding`, used by both;
    * the `TransformerEncoderBlock` and `TransformerDecoderBlock` layers, in the order the model
      calls them;
    * optional final normalizations, which must be named `encoder_norm` and `decoder_norm`
      (pre-LN models; another top-level `LayerNormalization` is a ValueError, as decoding
      could not tell where it belongs);
    * the output projection: the `Dense` layer named `logits`, else the last `Dense` layer; with
      none, the decoder embedding's transposed matrix (tied embeddings).

    `build_transformer` models and models built by hand as in docs/design.md have exactly these.
    Dropout layers are skipped (decoding is inference). The padding id comes from
    `model.special_ids` (0 for a model without one); a decoder whose start id is its padding id
    keeps its first position as a real token (`keep_first`).
    """

    encoder_embedding: TokenAndPositionEmbedding
    encoder_blocks: list
    encoder_norm: object
    decoder_embedding: TokenAndPositionEmbedding
    decoder_blocks: list
    decoder_norm: object
    output_projection: object
    pad_id: int = PAD_ID
    keep_first: bool = False

    @classmethod
    def from_model(cls, model, pad_id=None):
        layers = list(model.layers)
        by_name = {layer.name: layer for layer in layers}
        embeddings = [layer for layer in layers if isinstance(layer, TokenAndPositionEmbedding)]
        if "encoder_embedding" in by_name and "decoder_embedding" in by_name:
            embeddings = [by_name["encoder_embedding"], by_name["decoder_embedding"]]
        elif isinstance(by_name.get("shared_embedding"), TokenAndPositionEmbedding):
            embeddings = [by_name["shared_embedding"]] * 2
        encoder_blocks = [layer for layer in layers if isinstance(layer, TransformerEncoderBlock)]
        decoder_blocks = [layer for layer in layers if isinstance(layer, TransformerDecoderBlock)]
        if len(embeddings) != 2 or not encoder_blocks or not decoder_blocks:
            raise ValueError(
                f"Model {model.name!r} is not a keras_tfm encoder-decoder: generation needs two "
                "TokenAndPositionEmbedding layers (encoder, decoder) and at least one "
                "TransformerEncoderBlock and TransformerDecoderBlock; found "
                f"{len(embeddings)}, {len(encoder_blocks)} and {len(decoder_blocks)}."
            )
        dense = [layer for layer in layers if isinstance(layer, keras.layers.Dense)]
        projection = by_name.get("logits", dense[-1] if dense else None)
        norms = [layer for layer in layers if isinstance(layer, keras.layers.LayerNormalization)]
        unnamed = [n.name for n in norms if n.name not in ("encoder_norm", "decoder_norm")]
        if unnamed:
            raise ValueError(
                f"Model {model.name!r} has final LayerNormalization layers {unnamed}: generation "
                "recognises them only by the names 'encoder_norm' and 'decoder_norm' (as "
                "build_transformer names them); rename them so decoding matches the model."
            )
        own = getattr(model, "special_ids", {})
        pad_id = own.get("pad_id", PAD_ID) if pad_id is None else pad_id
        keep_first = own.get("start_id", None) == pad_id
        return cls(embeddings[0], encoder_blocks, by_name.get("encoder_norm"), embeddings[1],
                   decoder_blocks, by_name.get("decoder_norm"), projection, pad_id, keep_first)

    def transposable(self):
        """The layers whose products a search may take against transposed weights
        (`transposed_weights` picks): a tied logits table, and the products a decoding step
        takes of its one new token alone, each block's attention output projections and
        cross-attention query projection (its self-attention's query, key and value
        projections are one product under XLA: `fuses_projections`)."""
        layers = [self.decoder_embedding.token_embedding] if self.output_projection is None else []
        for block in self.decoder_blocks:
            layers.append(block.self_attention.output_dense)
            if block.cross_attention is not None:
                layers += [block.cross_attention.query_dense, block.cross_attention.output_dense]
        return layers

    @property
    def target_vocab_size(self):
        return self.decoder_embedding.vocab_size

    def encode(self, source_tokens):
        """Encoder output `(B, S, d_model)` and the source padding mask `(B, S)`."""
        mask = masks_lib.padding_mask(source_tokens, self.pad_id)
        x = call_layer(self.encoder_embedding, source_tokens)
        call_block = repeated_layer_caller(self.encoder_blocks)
        for i in range(len(self.encoder_blocks)):
            x = call_block(i, x, mask=mask)
        if self.encoder_norm is not None:
            x = call_layer(self.encoder_norm, x)
        return x, mask

    def cross_attention_caches(self, encoder_outputs):
        """Each decoder block's cross-attention keys and values `(B, H, S, d)`, a pair per
        block, split once here (see `cache_keys_values`)."""
        return [cache_keys_values(block.cross_attention.compute_context_cache(encoder_outputs))
                for block in self.decoder_blocks]

    def empty_self_attention_caches(self, batch_size, max_length):
        return [block.self_attention._empty_cache(batch_size, max_length, block.compute_dtype)
                for block in self.decoder_blocks]

    def cross_attention_weights(self, source_tokens, decoder_tokens):
        """Cross-attention weights of every decoder block for teacher-forced decoder tokens.

        Returns:
            A list (one per decoder block) of `(B, num_heads, T, S)` weights: row t tells how
            much target position t attends to each source token.
        """
        encoder_outputs, source_mask = self.encode(source_tokens)
        x = self.decoder_embedding(decoder_tokens)
        target_mask = masks_lib.padding_mask(decoder_tokens, self.pad_id,
                                             keep_first=self.keep_first)
        weights = []
        for block in self.decoder_blocks:
            x, _, cross = block(x, encoder_outputs, return_attention_scores=True,
                                inputs_mask=target_mask, encoder_outputs_mask=source_mask)
            weights.append(cross)
        return weights

    def decode_step(self, tokens, index, self_caches, cross_caches, source_mask):
        """Logits `(B, V)` (float32) of the tokens `(B, 1)` at position `index`, new caches."""
        x = call_layer(self.decoder_embedding, tokens, start_index=index)
        call_block = repeated_layer_caller(self.decoder_blocks)
        new_caches = []
        for i, (cache, cross) in enumerate(zip(self_caches, cross_caches)):
            x, cache = call_block(i, x, self_attention_cache=cache,
                                  self_attention_cache_update_index=index,
                                  cross_attention_cache=cross, encoder_outputs_mask=source_mask)
            new_caches.append(cache)
        if self.decoder_norm is not None:
            x = call_layer(self.decoder_norm, x)
        if self.output_projection is None:
            logits = call_layer(self.decoder_embedding, x, reverse=True)
        else:
            logits = call_layer(self.output_projection, x)
        return ops.cast(logits[:, 0], "float32"), new_caches


def _pad_remover(vocab, pad_id):
    """`without_pad(logits (B, vocab)) -> logits` with the padding token's logit made a large
    negative value: never generated. Built once before a search's loop (its `(vocab,)` row is
    not rebuilt at every step). The row is added (`suppress_token`: under PyTorch to the one
    column, in place), not a `where` over the whole `(B, vocab)` logits."""
    row = ops.where(ops.equal(ops.arange(vocab, dtype="int32"), pad_id), _NEG_INF, 0.0)
    return lambda logits: suppress_token(logits, pad_id, row)


def _log_probs_at(logits, values):
    """`log_softmax(logits)` at `values (B, n)`, some of each row's logits: each less the row's
    log-sum-exp (shifted by the row maximum, as a log-softmax is), without the log-softmax of
    the whole row (a `(B, vocab)` array written and read again at every step)."""
    top = ops.max(logits, axis=-1, keepdims=True)
    return (values - top) - ops.log(ops.sum(ops.exp(logits - top), axis=-1, keepdims=True))


def _chosen_log_probs(logits, chosen):
    """`log_softmax(logits)[b, chosen[b]]`, `(B,)`."""
    picked = ops.take_along_axis(logits, chosen[:, None], axis=-1)
    return _log_probs_at(logits, picked)[:, 0]


def _beam_candidates(logits, alive_log_probs, count):
    """The `count` best continuations of each source, best first: `(B, count)` log-probabilities
    (a beam's plus its token's), beams and tokens, over every (beam, token) of `logits
    (B * k, vocab)` and `alive_log_probs (B, k)`.

    Exact without the log-softmax of all `k * vocab` candidates: a log-softmax shifts a row by
    one constant, so a beam's `count` best continuations are its `count` largest logits; only
    those are normalised and ranked across beams.
    """
    batch, k = ops.shape(alive_log_probs)
    row_logits, row_tokens = top_k(logits, count)  # (B * k, count), sorted
    # (The row maximum is taken again, not sliced off `row_logits`: under XLA on the CPU that
    # slice made XLA sort whole rows instead of its top-k, 11 -> 680 ms at (64, 32000).)
    row_log_probs = ops.reshape(_log_probs_at(logits, row_logits), (batch, k, count))
    candidates = ops.reshape(alive_log_probs[:, :, None] + row_log_probs, (batch, k * count))
    top_log_probs, pick = ops.top_k(candidates, count)
    tokens = ops.take_along_axis(ops.reshape(row_tokens, (batch, k * count)), pick, axis=1)
    return top_log_probs, ops.cast(pick // count, "int32"), ops.cast(tokens, "int32")


def _greedy_search(parts, source, start_id, end_id, max_length, pad_id=PAD_ID, choose=None,
                   scored=True):
    """Greedy search (or sampling with `choose`): tokens `(B, max_length)` and, with `scored`,
    each row's log-probability `(B,)` (zeros without: the log-sum-exp of every step's
    `(B, vocab)` logits is then skipped, as `generate(return_scores=False)` asks)."""
    batch = ops.shape(source)[0]
    encoder_outputs, source_mask = parts.encode(source)
    cross = parts.cross_attention_caches(encoder_outputs)
    caches = parts.empty_self_attention_caches(batch, max_length)
    tokens = ops.concatenate([ops.full((batch, 1), start_id, "int32"),
                              ops.full((batch, max_length), pad_id, "int32")], axis=1)
    finished = ops.zeros((batch,), "bool")
    scores = ops.zeros((batch,), "float32")
    without_pad = _pad_remover(parts.target_vocab_size, pad_id)

    def cond(i, tokens, caches, finished, scores):
        return ops.logical_and(i < max_length, ops.logical_not(ops.all(finished)))

    def body(i, tokens, caches, finished, scores):
        current = ops.slice(tokens, (0, i), (batch, 1))
        logits, caches = parts.decode_step(current, i, caches, cross, source_mask)
        logits = without_pad(logits)
        chosen = (choose or _argmax)(logits, i, without_pad)
        if scored:
            scores = scores + ops.where(finished, 0.0, _chosen_log_probs(logits, chosen))
        chosen = ops.where(finished, pad_id, chosen)
        finished = ops.logical_or(finished, ops.equal(chosen, end_id))
        tokens = slice_update(tokens, (0, i + 1), chosen[:, None])
        return i + 1, tokens, caches, finished, scores

    state = (ops.convert_to_tensor(0, "int32"), tokens, caches, finished, scores)
    _, tokens, _, _, scores = ops.while_loop(cond, body, state, maximum_iterations=max_length)
    return tokens[:, 1:], scores


def _length_penalty(length, alpha):
    """((5 + length) / 6) ** alpha, the length penalty of Wu et al. (2016)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def _gather_beams(values, indices):
    """values (B, N, ...) gathered along the beam axis with indices (B, K)."""
    expanded = ops.reshape(indices, tuple(ops.shape(indices)) + (1,) * (len(values.shape) - 2))
    return ops.take_along_axis(values, expanded, axis=1)


def _beam_search(parts, source, start_id, end_id, max_length, beam_size, alpha, pad_id=PAD_ID):
    batch, k = ops.shape(source)[0], beam_size
    length = max_length + 1
    encoder_outputs, source_mask = parts.encode(source)
    # Beams are folded into the batch: row b * k + j is beam j of source b. The k beams of a
    # source share its cross-attention keys and values (`fold_query_rows`): one row, not k.
    cross = parts.cross_attention_caches(encoder_outputs)
    caches = parts.empty_self_attention_caches(batch * k, max_length)

    alive_seq = ops.concatenate([ops.full((batch, k, 1), start_id, "int32"),
                                 ops.full((batch, k, max_length), pad_id, "int32")], axis=2)
    # Only the first beam is alive at the start, so the first step expands one hypothesis.
    first = ops.concatenate([ops.zeros((1,)), ops.full((k - 1,), _NEG_INF)], axis=0)
    alive_log_probs = ops.tile(ops.cast(first, "float32")[None], (batch, 1))
    finished_seq = ops.full((batch, k, length), pad_id, "int32")
    finished_scores = ops.full((batch, k), _NEG_INF, "float32")
    finished_log_probs = ops.full((batch, k), _NEG_INF, "float32")
    finished_flags = ops.zeros((batch, k), "bool")
    max_penalty = _length_penalty(max_length, alpha)
    offsets = ops.arange(batch, dtype="int32")[:, None] * k
    without_pad = _pad_remover(parts.target_vocab_size, pad_id)

    def cond(i, alive_seq, alive_log_probs, caches, finished_seq, finished_scores,
             finished_log_probs, finished_flags):
        # Stop early once no alive beam can beat the worst kept finished hypothesis: log
        # probabilities only fall, and the penalty is at most the one of max_length.
        best_alive = alive_log_probs[:, 0] / max_penalty
        worst_finished = ops.min(ops.where(finished_flags, finished_scores, 0.0), axis=1)
        worst_finished = ops.where(ops.any(finished_flags, axis=1), worst_finished, _NEG_INF)
        bound_met = ops.all(ops.greater(worst_finished, best_alive))
        return ops.logical_and(i < max_length, ops.logical_not(bound_met))

    def body(i, alive_seq, alive_log_probs, caches, finished_seq, finished_scores,
             finished_log_probs, finished_flags):
        current = ops.reshape(ops.slice(alive_seq, (0, 0, i), (batch, k, 1)), (batch * k, 1))
        logits, caches = parts.decode_step(current, i, caches, cross, source_mask)
        # 2k candidates: even if k of them end here, k stay alive.
        top_log_probs, top_beam, top_token = _beam_candidates(
            without_pad(logits), alive_log_probs, 2 * k)
        top_seq = _gather_beams(alive_seq, top_beam)
        position = ops.equal(ops.arange(length, dtype="int32"), i + 1)
        top_seq = ops.where(position[None, None, :], top_token[:, :, None], top_seq)
        ends = ops.equal(top_token, end_id)

        alive_candidates = ops.where(ends, _NEG_INF, top_log_probs)
        alive_log_probs, alive_pick = ops.top_k(alive_candidates, k)
        alive_seq = _gather_beams(top_seq, alive_pick)
        parent = ops.reshape(_gather_beams(top_beam, alive_pick) + offsets, (-1,))
        filled = i + 1  # positions 0 … i of every cache hold keys and values
        caches = reorder_beams(caches, parent, filled)

        # Finished hypotheses are kept aside, ranked by their length-penalised score.
        new_scores = ops.where(ends, top_log_probs / _length_penalty(i + 1, alpha), _NEG_INF)
        merged_scores = ops.concatenate([finished_scores, new_scores], axis=1)
        finished_scores, pick = ops.top_k(merged_scores, k)
        finished_seq = _gather_beams(ops.concatenate([finished_seq, top_seq], axis=1), pick)
        finished_log_probs = _gather_beams(
            ops.concatenate([finished_log_probs, top_log_probs], axis=1), pick)
        finished_flags = _gather_beams(ops.concatenate([finished_flags, ends], axis=1), pick)
        return (i + 1, alive_seq, alive_log_probs, caches, finished_seq, finished_scores,
                finished_log_probs, finished_flags)

    state = (ops.convert_to_tensor(0, "int32"), alive_seq, alive_log_probs, caches,
             finished_seq, finished_scores, finished_log_probs, finished_flags)
    state = ops.while_loop(cond, body, state, maximum_iterations=max_length)
    (steps, alive_seq, alive_log_probs, _, finished_seq, finished_scores, finished_log_probs,
     _) = state
    # The best alive beam (cut at max_length without <EOS>) competes with the best finished
    # hypothesis on the same length-penalised score; with no finished one it wins outright.
    alive_score = alive_log_probs[:, 0] / _length_penalty(steps, alpha)
    take_alive = ops.greater(alive_score, finished_scores[:, 0])
    tokens = ops.where(take_alive[:, None], alive_seq[:, 0], finished_seq[:, 0])
    scores = ops.where(take_alive, alive_log_probs[:, 0], finished_log_probs[:, 0])
    return tokens[:, 1:], scores


_COMPILED = weakref.WeakKeyDictionary()


_XLA_ROWS = 17  # TensorFlow compiles searches of at least this many rows with XLA (`_compile`)


def _compiles_per_shape(rows, static_shapes=False):
    """Whether a search of `rows` rows (sources × beams) is compiled once per input shape:
    always under JAX (jit); under TensorFlow from `_XLA_ROWS` rows (XLA, see `_compile`), and
    always with `static_shapes`. Such searches get a filled last chunk, and translation's
    bucketed sources ("auto" `length_buckets`)."""
    backend = keras.backend.backend()
    return backend == "jax" or (backend == "tensorflow"
                                 and (static_shapes or rows >= _XLA_ROWS))


def _compile(model, search, static_shapes=False, beams=1, transposable=()):
    """Compile `search(*inputs)` once per model and settings, where the backend allows it.

    The one backend-specific piece of generation: JAX jit-compiles with the model's variables
    passed in (a StatelessScope), so later weight updates are seen without recompiling, and
    on the CPU at LLVM's optimization level 1, a search of at most 16 rows without YNNPACK
    (`compiler_options`) and with the products of the layers `transposable` that
    `transposed_weights` picks against transposed copies of their weights;
    TensorFlow traces a tf.function without AutoGraph (variables are read live); PyTorch runs
    eagerly without autograd, with glibc asked to keep freed memory (`keep_freed_memory`).
    JAX retraces for each new input shape. TensorFlow with `static_shapes` (a search whose
    cache size depends on an input's shape) traces one graph per shape, never with XLA;
    otherwise it compiles a search of `_XLA_ROWS` rows or more (sources × `beams`) with XLA,
    once per input shape (on any device; measured on the CPU), and runs a smaller one as one
    graph traced once with every dimension unknown, which serves every such shape. Measured on
    a 2-core AMD EPYC (opus-mt-base, 32 new tokens, warm, in one process, in turns), the graph
    against XLA: one row 0.45-0.55 against 1.33-1.53 s (XLA's own loops for one row), 8
    rows 1.02 / 0.99 s, 16 rows 1.48 / 1.40 s, 4 sources × beam 4 1.41 / 1.29 s, but 32 rows
    2.21 / 1.97 s, 8 × beam 4 2.48 / 1.94 s, 64 rows 4.11 / 3.07 s; and XLA's first call of
    each shape costs 3-6 s more (trace and compile: 16 rows 1.3-3.3 against 6.3-6.8 s), so up
    to 16 rows the graph's one trace wins (100 sources of 5-60 tokens in chunks of 16, first
    call: 15.5-16.7 → 11.2-11.8 s). Layers run their `call` directly
    (`direct_calls`: eager PyTorch would otherwise pay Keras's `__call__` at every step), and
    TensorFlow traces a stack of alike blocks once (`repeated_layer_caller`).
    """
    backend = keras.backend.backend()

    def direct(*inputs, xla=False, transposed=None):  # `call` without Keras's bookkeeping
        with direct_calls(xla=xla, transposed=transposed):
            return search(*inputs)

    if backend == "jax":
        import jax

        variables = list(model.variables)

        def jitted(options, transposing):
            def stateless(values, transposed, *inputs):
                with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                    return direct(*inputs, transposed=dict(zip(transposing, transposed)))

            return jax.jit(stateless, compiler_options=options)

        compiled = {}  # (options, the layers transposed) -> the jitted search

        def run(*inputs):
            rows = inputs[0].shape[0] * beams
            options = compiler_options(rows, model._flatten_layers())
            transposing = transposed_weights(transposable, rows)
            key = (frozenset((options or {}).items()), tuple(map(id, transposing)))
            if key not in compiled:
                compiled[key] = jitted(options, transposing)
            return compiled[key]([v.value for v in variables],
                                 [transposed_weight(layer) for layer in transposing], *inputs)

        return run
    if backend == "tensorflow":
        import tensorflow as tf

        # No AutoGraph: the search's control flow is `ops.while_loop` already, and converting
        # every function it calls made the first call 4.9 s instead of 1.9 (opus-mt-base).
        if static_shapes:
            return tf.function(direct, autograph=False)
        def traced(xla, inputs):
            if xla:  # no input signature: one trace (and XLA compilation) per input shape
                return tf.function(lambda *x: direct(*x, xla=True), autograph=False,
                                   jit_compile=True)
            # one graph of unknown dimensions, traced at the first call
            return tf.function(direct, autograph=False, input_signature=[
                tf.TensorSpec([None] * len(x.shape), tf.as_dtype(x.dtype)) for x in inputs])

        functions = {}  # with XLA or not -> its tf.function

        def run(*inputs):
            xla = _compiles_per_shape(inputs[0].shape[0] * beams)
            if xla not in functions:
                functions[xla] = traced(xla, inputs)
            return functions[xla](*inputs)

        return run
    if backend == "torch":
        import torch

        keep_freed_memory()  # (fresh arrays a step would otherwise page-fault: see there)

        def run(*inputs):
            with torch.no_grad():
                return direct(*inputs)

        return run
    return direct


_MAX_COMPILED = 8  # compiled searches kept per model (settings), least recently used dropped


_POWERS_OF_TWO = [2 ** n for n in range(3, 31)]  # "auto" length buckets: 8, 16, 32, 64, …
_FINE_BUCKETS = sorted(_POWERS_OF_TWO + [3 * b // 2 for b in _POWERS_OF_TWO])  # 8, 12, 16, 24, …
_FINE_BUCKET_ROWS = 16  # "auto" takes `_FINE_BUCKETS` for searches of at least this many rows


def _bucket_sources(source_tokens, length_buckets, pad_id, encoder_embedding, rows):
    """The sources right-padded with `pad_id` to the smallest bucket that holds them, so that a
    search compiled per shape retraces once per bucket, not per source length. Padding is
    masked, so the tokens cannot change. "auto" pads where the search of `rows` rows (a
    chunk's sources × beams) compiles per shape (`_compiles_per_shape`: JAX, TensorFlow's
    XLA): to powers of two from 8, and from `_FINE_BUCKET_ROWS` rows to those and their
    halfway points (8, 12, 16, 24, 32, 48, …: at most a third of a padded source is padding,
    against a half). At many rows the encoder's products (and the cross-attention keys and
    values) grow with the padding, at a few rows a step's cost is reading the weights, and
    each bucket is one more compilation. Measured under JAX, opus-mt-base, sources of 24
    tokens padded to 24 or 32, 32 new tokens, two models in one process in turns, medians of 5
    (2-core AMD EPYC): 16 rows 1.10 → 1.05 s, 64 rows 2.79 → 2.63, 16 sources × beam 4 3.14 →
    2.99; 1, 2, 4 and 8 rows and 1 source × beam 4 level. None under TensorFlow's one graph of
    unknown dimensions, which serves every shape, and none under PyTorch (eager): there padding
    would only add work. No bucket exceeds a learned position table; a source longer than
    every bucket stays as it is.
    """
    auto = isinstance(length_buckets, str) and length_buckets == AUTO
    if not auto and length_buckets is not None and not (
            isinstance(length_buckets, (list, tuple)) and length_buckets
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                    for b in length_buckets)
            and list(length_buckets) == sorted(set(length_buckets))):
        raise ValueError('`length_buckets` must be "auto", None or an increasing sequence of '
                         f"positive ints; received length_buckets={length_buckets!r}.")
    if auto and _compiles_per_shape(rows):
        length_buckets = _FINE_BUCKETS if rows >= _FINE_BUCKET_ROWS else _POWERS_OF_TWO
    elif auto or length_buckets is None:
        return source_tokens
    width = source_tokens.shape[1]
    limit = encoder_embedding.max_length if encoder_embedding.positional == "learned" else None
    fits = [b for b in length_buckets if b >= width and (limit is None or b <= limit)]
    if not fits:
        return source_tokens
    return np.pad(source_tokens, ((0, 0), (0, min(fits) - width)), constant_values=pad_id)


def _resolve_special_ids(model, vocab, start_id, end_id, pad_id, needs_start=True):
    """The start, end and padding ids of one `generate` call: explicit arguments win; "auto"
    takes the model's own (`model.special_ids`; padding defaults to 0). A language model
    (`needs_start=False`) continues its prompts and takes no start id."""
    own = getattr(model, "special_ids", {})
    if pad_id == AUTO:
        pad_id = own.get("pad_id", PAD_ID)
    asked = (("start_id", start_id, "start_id=..."),) if needs_start else ()
    for name, value, hint in asked + (("end_id", end_id, "end_id=..., or end_id=None to "
                                                         "decode max_length tokens"),):
        if value == AUTO and name not in own:
            raise ValueError(f"`{name}` was not given and model {model.name!r} has no {name} of "
                             f"its own (model.special_ids={own}); pass {hint}.")
    if not needs_start:
        if start_id not in (AUTO, None):
            raise ValueError(f"A language model continues its prompts and takes no `start_id` "
                             f"(put a start token in the prompts); received start_id={start_id!r}.")
        start_id = own.get("start_id", pad_id)  # unused; checked as a valid id below
    start_id = own["start_id"] if start_id == AUTO else start_id
    end_id = own["end_id"] if end_id == AUTO else end_id
    check_special_ids(vocab, pad_id, start_id, end_id)
    if needs_start and start_id == pad_id and own.get("start_id") != pad_id:
        raise ValueError(f"`start_id` must not be the padding id {pad_id}, which model "
                         f"{model.name!r} masks; received start_id={start_id!r}. (A model built "
                         "with start_id == pad_id, as from_marian does, attends to it.)")
    return (None if start_id is None else int(start_id), None if end_id is None else int(end_id),
            None if pad_id is None else int(pad_id))


def _source_array(source_tokens, vocab, pad_id):
    """The sources as int32 `(B, S)`, checked: Python lists of different lengths are
    right-padded with `pad_id`; ids must lie in the source vocabulary; a source with padding
    before a real token (left padding) is refused."""
    if isinstance(source_tokens, (list, tuple)) and all(
            isinstance(row, (list, tuple, np.ndarray)) for row in source_tokens):
        rows = [np.asarray(row).reshape(-1) for row in source_tokens]
        width = max((len(row) for row in rows), default=0)
        if any(len(row) != width for row in rows):
            source_tokens = np.full((len(rows), width), pad_id, np.result_type(*rows))
            for i, row in enumerate(rows):
                source_tokens[i, :len(row)] = row
    source_tokens = check_token_ids(source_tokens, vocab, name="source_tokens")
    if source_tokens.shape[0] == 0:
        raise ValueError("`source_tokens` must hold at least one source; received shape "
                         f"{source_tokens.shape}.")
    is_pad = source_tokens == pad_id
    padding_first = is_pad[:, :-1] & ~is_pad[:, 1:]
    if padding_first.any():
        row = int(np.flatnonzero(padding_first.any(axis=1))[0])
        raise ValueError(
            f"`source_tokens` row {row} has padding (id {pad_id}) before a real token: "
            f"{source_tokens[row].tolist()}. keras_tfm sources are right-padded (the padding at "
            "the end); with keras.utils.pad_sequences pass padding='post'.")
    return source_tokens


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
    sampling = _sampling_options(method, temperature, top_k, top_p)
    _check_lengths(max_length, batch_size)
    if isinstance(model, LanguageModel):
        return generate_language_model(model, source_tokens, max_length, end_id=end_id,
                                       pad_id=pad_id, start_id=start_id, method=method,
                                       return_scores=return_scores, batch_size=batch_size,
                                       verbose=verbose, seed=seed, **sampling)
    parts = Seq2SeqParts.from_model(model)
    vocab = parts.target_vocab_size
    start_id, end_id, pad_id = _resolve_special_ids(model, vocab, start_id, end_id, pad_id)
    if pad_id != parts.pad_id:
        parts = dataclasses.replace(parts, pad_id=pad_id)
    embedding = parts.decoder_embedding
    if embedding.positional == "learned" and max_length > embedding.max_length:
        raise ValueError(
            f"`max_length`={max_length} exceeds the decoder's learned position table "
            f"(max_length={embedding.max_length}): step t is embedded at position t."
        )
    if not length_penalty >= 0:
        raise ValueError(f"`length_penalty` must be >= 0; received {length_penalty!r}.")
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"`beam_size` must be a positive integer; received {beam_size!r}.")
    if method == "beam" and 2 * beam_size > vocab - 1:
        raise ValueError(
            f"`beam_size`={beam_size} is too large for a target vocabulary of {vocab}: beam "
            "search draws 2 * beam_size candidates among the non-padding tokens."
        )
    source_tokens = _source_array(source_tokens, parts.encoder_embedding.vocab_size, pad_id)
    table = parts.encoder_embedding.max_length
    if parts.encoder_embedding.positional == "learned" and source_tokens.shape[1] > table:
        raise ValueError(f"Sources of length {source_tokens.shape[1]} exceed the encoder's "
                         f"learned position table (max_length={table}).")
    beams = beam_size if method == "beam" else 1
    rows = min(batch_size or len(source_tokens), len(source_tokens)) * beams
    source_tokens = _bucket_sources(source_tokens, length_buckets, pad_id,
                                    parts.encoder_embedding, rows)
    stop_id = _NO_END if end_id is None else end_id

    inputs = [source_tokens]
    if method == "sample":
        key = ("sample", return_scores, start_id, stop_id, pad_id, max_length,
               tuple(sampling.items()))
        inputs.append(_uniforms(seed, len(source_tokens), max_length))

        def search(source, uniforms):
            return _greedy_search(parts, source, start_id, stop_id, max_length, pad_id,
                                  _chooser(sampling, uniforms), scored=return_scores)
    elif method == "greedy" or beam_size == 1:  # one beam is greedy search
        key = ("greedy", return_scores, start_id, stop_id, pad_id, max_length)

        def search(source):
            return _greedy_search(parts, source, start_id, stop_id, max_length, pad_id,
                                  scored=return_scores)
    else:
        key = ("beam", start_id, stop_id, pad_id, max_length, beam_size, float(length_penalty))

        def search(source):
            return _beam_search(parts, source, start_id, stop_id, max_length, beam_size,
                                float(length_penalty), pad_id)

    return _run_in_chunks(model, key, search, inputs, batch_size, verbose, pad_id, return_scores,
                          beams=beams, sources=True, transposable=parts.transposable())


def _run_in_chunks(model, key, search, inputs, batch_size, verbose, pad_id, return_scores,
                   static_shapes=False, beams=1, sources=False, transposable=()):
    """Compile `search` once per `key`, run it on chunks of the NumPy `inputs` (rows along the
    first axis; each decoded with `beams` beams) and return the tokens, cut after the longest
    sequence, and the scores, rows in the order given.

    `transposable`: layers whose products may take transposed weights (`_compile`).
    `sources`: `inputs[0]` holds right-padded sources. Where chunks are not compiled per shape
    (PyTorch; TensorFlow's graph below `_XLA_ROWS` rows), the rows are then taken shortest
    source first and each chunk cut to its longest source, so a chunk encodes and attends to
    little padding (CTranslate2 sorts a batch by length too). Padding is masked: the tokens
    are those of any other chunking. Measured under torch, 100 sources of 5-60 tokens in
    chunks of 16 (opus-mt-base, 32 new tokens; medians of 4 calls in turns): 6.5 -> 5.9 s.
    """
    # The variables are part of the key: `model.quantize` replaces them, and a search compiled
    # over the old ones (JAX passes them in, TensorFlow captures them) would ignore the change.
    variables = tuple(id(v) for v in model.variables)
    cached = _COMPILED.get(model)
    if cached is None or cached[0] != variables:
        cached = _COMPILED[model] = (variables, {})
    compiled = cached[1]
    run = compiled.pop(key, None) or _compile(model, search, static_shapes, beams, transposable)
    compiled[key] = run  # the most recently used last
    while len(compiled) > _MAX_COMPILED:
        del compiled[next(iter(compiled))]

    chunk = batch_size or len(inputs[0])
    starts = range(0, len(inputs[0]), chunk)
    order = None
    if sources and len(starts) > 1 and not _compiles_per_shape(chunk * beams, static_shapes):
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
        if rows < chunk and n > 0 and _compiles_per_shape(chunk * beams, static_shapes):
            # A shorter last chunk would compile the search again (~1-1.5 s for opus-mt-base,
            # against ~0.5 s to decode 16 rows): filled up with copies of its first row, whose
            # results are dropped (rows never interact).
            part = [np.concatenate([x, np.repeat(x[:1], chunk - rows, axis=0)]) for x in part]
        tokens, scores = run(*[ops.convert_to_tensor(x) for x in part])
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


# --- decoder-only language models and sampling ----------------------------------------------------


@dataclasses.dataclass
class LanguageModelParts:
    """The layers of a `LanguageModel` (from `build_language_model`), found by name.

    `token_embedding`, the additive positions (`position_encoding` / `position_embedding`, None
    with rotary positions, which live in the attention), the `decoder_block_{i}` layers (no
    cross-attention), the optional `final_norm` and the `logits` projection.
    """

    token_embedding: object
    position: object
    blocks: list
    final_norm: object
    output_projection: object
    embedding_scale: object
    pad_id: int = PAD_ID
    suppress_pad: bool = True  # False: a model without padding (`pad_id` only fills rows)

    @classmethod
    def from_model(cls, model):
        if not isinstance(model, LanguageModel):
            raise ValueError(f"Model {model.name!r} is not a keras_tfm language model (a "
                             "LanguageModel from build_language_model).")
        by_name = {layer.name: layer for layer in model.layers}
        blocks = [layer for layer in model.layers if isinstance(layer, TransformerDecoderBlock)]
        position = by_name.get("position_encoding", by_name.get("position_embedding"))
        config = model.get_config()
        scale = config["d_model"] ** 0.5 if config["scale_embeddings"] else None
        return cls(by_name["token_embedding"], position, blocks, by_name.get("final_norm"),
                   by_name["logits"], scale, model.special_ids.get("pad_id", PAD_ID))

    @property
    def vocab_size(self):
        return self.token_embedding.input_dim

    def empty_caches(self, batch_size, max_length):
        return [block.self_attention._empty_cache(batch_size, max_length, block.compute_dtype)
                for block in self.blocks]

    def forward(self, tokens, index, caches):
        """Logits `(B, T, V)` (float32) of `tokens (B, T)` at positions `index …`, new caches."""
        x = call_layer(self.token_embedding, tokens)
        if self.embedding_scale is not None:
            x = x * ops.cast(self.embedding_scale, x.dtype)
        if self.position is not None:
            x = call_layer(self.position, x, start_index=index)
        call_block = repeated_layer_caller(self.blocks)
        new_caches = []
        for i, cache in enumerate(caches):
            x, cache = call_block(i, x, self_attention_cache=cache,
                                  self_attention_cache_update_index=index)
            new_caches.append(cache)
        if self.final_norm is not None:
            x = call_layer(self.final_norm, x)
        return ops.cast(call_layer(self.output_projection, x), "float32"), new_caches


def _sample(logits, uniform, without_pad, temperature, top_k, top_p):
    """Draw one token per row from `softmax(logits / temperature)` restricted to the `top_k`
    most likely tokens and then to the nucleus (the smallest set of tokens whose probability
    reaches `top_p`, renormalised), by inverse transform of `uniform (B,)` in [0, 1).
    `without_pad` (`_pad_remover`) applies after the temperature, so no temperature brings the
    padding token back."""
    vocab = logits.shape[-1]
    logits = without_pad(logits / temperature)
    if top_k == 1:
        return argmax(logits)
    if top_k is not None or top_p < 1.0:
        logits, order = ops.top_k(logits, min(top_k or vocab, vocab))  # sorted, descending
    else:
        order = None
    probs = ops.softmax(logits, axis=-1)
    if top_p < 1.0:
        # keep a token while the probability of the more likely ones is still below top_p
        before = ops.cumsum(probs, axis=-1) - probs
        probs = ops.where(before < top_p, probs, 0.0)
    cdf = ops.cumsum(probs, axis=-1)
    target = uniform[:, None] * cdf[:, -1:]
    pick = ops.sum(ops.cast(cdf <= target, "int32"), axis=-1)
    pick = ops.minimum(pick, ops.shape(probs)[-1] - 1)[:, None]
    if order is not None:
        pick = ops.take_along_axis(order, pick, axis=-1)
    return ops.cast(pick[:, 0], "int32")


def _argmax(logits, i, without_pad):
    """The greedy choice of one step, `(B,)` int32 (of logits without the padding token
    already)."""
    return argmax(logits)


def _chooser(sampling, uniforms):
    """`choose(logits, step, without_pad) -> (B,) int32`: a draw with the step's column of
    `uniforms (B, steps)`, the padding token removed by `without_pad` (`_pad_remover`)."""

    def choose(logits, i, without_pad):
        uniform = ops.slice(uniforms, (0, i), (ops.shape(uniforms)[0], 1))[:, 0]
        return _sample(logits, uniform, without_pad, **sampling)

    return choose


def _language_model_search(parts, prompts, lengths, end_id, max_length, choose=None,
                           scored=True):
    """Continue right-padded `prompts (B, P)` of `lengths (B,)` by up to `max_length` tokens
    (with `scored`, and their log-probabilities; zeros without, as in `_greedy_search`).

    The whole prompt is prefilled in one pass; then every row steps through the same positions
    `i = min(lengths) …` one token at a time, keeping its own prompt token while `i` is inside
    its prompt: each row's position `i` sees its own tokens `0 … i` only, as if alone.
    """
    pad_id = parts.pad_id
    batch, prompt_length = ops.shape(prompts)[0], prompts.shape[1]
    total = prompt_length + max_length
    tokens = ops.concatenate([prompts, ops.full((batch, max_length), pad_id, "int32")], axis=1)
    caches = parts.empty_caches(batch, total)
    prefill_logits, caches = parts.forward(prompts, 0, caches)
    start = ops.min(lengths)
    logits = ops.take(prefill_logits, start - 1, axis=1)
    choose = choose or _argmax
    finished = ops.zeros((batch,), "bool")
    scores = ops.zeros((batch,), "float32")
    without_pad = (_pad_remover(parts.vocab_size, pad_id) if parts.suppress_pad
                   else lambda logits: logits)

    def cond(i, tokens, caches, logits, finished, scores):
        return ops.logical_and(i < total, ops.logical_not(ops.all(finished)))

    def body(i, tokens, caches, logits, finished, scores):
        logits = without_pad(logits)
        chosen = choose(logits, i, without_pad)
        in_prompt = i < lengths
        new = ops.logical_and(ops.logical_not(in_prompt), ops.logical_not(finished))
        if scored:
            scores = scores + ops.where(new, _chosen_log_probs(logits, chosen), 0.0)
        current = ops.slice(tokens, (0, i), (batch, 1))[:, 0]
        current = ops.where(in_prompt, current, ops.where(finished, pad_id, chosen))
        finished = ops.logical_or(finished, ops.logical_and(new, ops.equal(chosen, end_id)))
        finished = ops.logical_or(finished, i + 1 >= lengths + max_length)
        tokens = slice_update(tokens, (0, i), current[:, None])
        step_logits, caches = parts.forward(current[:, None], i, caches)
        return i + 1, tokens, caches, step_logits[:, 0], finished, scores

    state = (start, tokens, caches, logits, finished, scores)
    _, tokens, _, _, _, scores = ops.while_loop(cond, body, state, maximum_iterations=total)
    positions = lengths[:, None] + ops.arange(max_length, dtype="int32")[None, :]
    return ops.take_along_axis(tokens, positions, axis=1), scores


def _unpadded_prompts(prompts, vocab, fill):
    """Prompts of a model without padding as int32 `(B, P)` (shorter rows filled with `fill`,
    which the search never attends to) and their lengths `(B,)`: rows of a list keep their own
    lengths, every row of an array is all tokens."""
    if isinstance(prompts, (list, tuple)) and all(
            isinstance(row, (list, tuple, np.ndarray)) for row in prompts):
        rows = [np.asarray(row).reshape(-1) for row in prompts]
    else:
        rows = list(np.asarray(prompts).reshape(-1, np.shape(prompts)[-1]))
    lengths = np.array([len(row) for row in rows], "int32")
    array = np.full((len(rows), max(lengths, default=0)), fill, "int64")
    for i, row in enumerate(rows):
        array[i, :len(row)] = row
    return check_token_ids(array, vocab, name="prompts"), lengths


def _sampling_options(method, temperature, top_k, top_p):
    """The checked options of `method="sample"` (a dict for `_sample`); {} for the others."""
    if method not in ("greedy", "beam", "sample"):
        raise ValueError(f'`method` must be "greedy", "beam" or "sample"; received {method!r}.')
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0):
        raise ValueError(f"`temperature` must be > 0; received temperature={temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"`top_k` must be a positive integer or None; received top_k={top_k!r}.")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"`top_p` must be in (0, 1]; received top_p={top_p!r}.")
    if method != "sample":
        return {}
    return {"temperature": float(temperature), "top_k": top_k, "top_p": float(top_p)}


def _check_lengths(max_length, batch_size):
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"`max_length` must be a positive integer; received {max_length!r}.")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(
            batch_size, int) or batch_size < 1):
        raise ValueError(f"`batch_size` must be a positive integer or None; received "
                         f"{batch_size!r}.")


def _uniforms(seed, batch, steps):
    """float32 uniforms in [0, 1) `(batch, steps)` from a NumPy generator: the draws of
    sampling are inputs of the compiled search, the same for a seed on every backend."""
    return np.random.default_rng(seed).random((batch, steps), dtype=np.float32)


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
    sampling = _sampling_options(method, temperature, top_k, top_p)
    if method == "beam":
        raise ValueError('A language model decodes with method="greedy" or "sample"; received '
                         'method="beam".')
    _check_lengths(max_length, batch_size)
    parts = LanguageModelParts.from_model(model)
    if pad_id == AUTO and "pad_id" not in model.special_ids:
        pad_id = None  # a model without padding (`pad_id=None`)
    _, end_id, pad_id = _resolve_special_ids(model, parts.vocab_size, start_id, end_id, pad_id,
                                             needs_start=False)
    if pad_id is None:  # every id is a token: lengths from the rows, rows filled by `fill`
        fill = PAD_ID if end_id is None else end_id
        parts = dataclasses.replace(parts, pad_id=fill, suppress_pad=False)
        prompts, lengths = _unpadded_prompts(prompts, parts.vocab_size, fill)
    else:
        parts = dataclasses.replace(parts, pad_id=pad_id)
        prompts = _source_array(prompts, parts.vocab_size, pad_id)
        lengths = (prompts != pad_id).sum(axis=1).astype("int32")
    if (lengths == 0).any():
        row = int(np.flatnonzero(lengths == 0)[0])
        raise ValueError(f"Every prompt needs at least one real token; prompt {row} is only "
                         f"padding (id {pad_id}).")
    prompts = prompts[:, :lengths.max()]
    table = getattr(parts.position, "sequence_length", None)
    if table is not None and prompts.shape[1] + max_length > table:
        raise ValueError(
            f"The longest prompt ({prompts.shape[1]} tokens) plus max_length={max_length} "
            f"exceeds the learned position table (max_length={table}) of model {model.name!r}.")
    stop_id = _NO_END if end_id is None else end_id
    inputs = [prompts, lengths]
    key = ("language_model", method, return_scores, stop_id, pad_id, max_length,
           tuple(sampling.items()))
    if method == "sample":
        inputs.append(_uniforms(seed, len(prompts), prompts.shape[1] + max_length))

        def search(prompts, lengths, uniforms):
            return _language_model_search(parts, prompts, lengths, stop_id, max_length,
                                          _chooser(sampling, uniforms),
                                          scored=return_scores)
    else:
        def search(prompts, lengths):
            return _language_model_search(parts, prompts, lengths, stop_id, max_length,
                                          scored=return_scores)

    # The caches hold prompt length + max_length positions: a static shape for tf.function.
    return _run_in_chunks(model, key, search, inputs, batch_size, verbose, pad_id, return_scores,
                          static_shapes=True)

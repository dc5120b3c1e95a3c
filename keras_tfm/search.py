"""The search of cached decoding: one loop for translation and language models, with greedy
search, sampling and beam search as small strategy objects, and its compiled form. A decoder
has `call_with_cache(tokens, cache, index) -> (logits, cache)` (`Seq2SeqTransformer`,
`Seq2SeqParts`, `LanguageModel`); every row starts from a prompt (a translation's: its start
id), and the strategy turns the logits of position i into the token at i + 1."""

import dataclasses
import weakref

import keras
import numpy as np
from keras import ops

from keras_tfm._backend import (few_rows_options, quantized_variables, reorder_beams,
                                suppress_token, xla_cpu)

NO_END = -1  # `end_id=None`: an id that never comes, so decoding runs to max_length
NEG_INF = -1e9  # finite: -inf - -inf would give NaN in the beam bookkeeping
XLA_ROWS = 17  # TensorFlow compiles a search of at least this many rows with XLA (`compile`)
MAX_COMPILED = 8  # compiled searches kept per model, the least recently used dropped
_CHUNK = 128  # row positions per chunk of the two-stage `argmax` and `top_k`


def _chunks(x):  # `x (B, V)` as `(B, n, _CHUNK)` chunks of positions (-inf fills the last)
    rows, size = ops.shape(x)
    n = -(-size // _CHUNK)
    x = ops.pad(x, ((0, 0), (0, n * _CHUNK - size)), constant_values=float("-inf"))
    return ops.reshape(x, (rows, n, _CHUNK))


def _pick_chunks(chunks, which):  # the chunks `which (B, m)` of each row, `(B, m * _CHUNK)`
    picked = ops.take_along_axis(chunks, which[:, :, None], axis=1)
    return ops.reshape(picked, (ops.shape(which)[0], -1))


def _row_positions(which, position):  # row positions of positions in `_pick_chunks`
    return ops.take_along_axis(which, position // _CHUNK, axis=1) * _CHUNK + position % _CHUNK


def argmax(x):
    """`ops.argmax(x, axis=-1)` of `x (B, V)` as int32; under JAX on the CPU in two stages: the
    first chunk of 128 holding the row's maximum, then the first position in it."""
    if not xla_cpu():
        return ops.cast(ops.argmax(x, axis=-1), "int32")
    chunks = _chunks(x)
    which = ops.cast(ops.argmax(ops.max(chunks, axis=-1), axis=-1), "int32")[:, None]
    inside = ops.cast(ops.argmax(_pick_chunks(chunks, which), axis=-1), "int32")[:, None]
    return _row_positions(which, inside)[:, 0]


def top_k(x, k):
    """`ops.top_k(x, k)` of `x (B, V)`, int32 indices, equal values lower index first; under JAX
    on the CPU in two exact stages: the k chunks of 128 with the largest maxima (they hold the
    k largest values), in position order, then the top k of their `k * 128` values."""
    if not xla_cpu() or ops.shape(x)[-1] <= k * _CHUNK:
        values, indices = ops.top_k(x, k)
        return values, ops.cast(indices, "int32")
    chunks = _chunks(x)
    _, which = ops.top_k(ops.max(chunks, axis=-1), k)
    which = ops.sort(ops.cast(which, "int32"), axis=-1)
    values, position = ops.top_k(_pick_chunks(chunks, which), k)
    return values, _row_positions(which, ops.cast(position, "int32"))


@dataclasses.dataclass(frozen=True)
class Settings:
    """One search's settings: what its compiled function depends on (the compile cache's key).

    `strategy`: `Greedy()`, `Sample(...)` or `Beam(...)`; `end_id`: `NO_END` to decode
    `max_length` tokens; `suppress_pad`: never generate `pad_id`; `scored`: also sum the
    chosen tokens' log-probabilities (greedy and sampling; beam search always scores).
    """

    strategy: object
    max_length: int
    end_id: int
    pad_id: int
    suppress_pad: bool = True
    scored: bool = True


def _log_probs_at(logits, values):
    """`log_softmax(logits)` at `values (B, n)`, some of each row's logits: each less the row's
    log-sum-exp, without the log-softmax of the whole `(B, vocab)` row."""
    top = ops.max(logits, axis=-1, keepdims=True)
    return (values - top) - ops.log(ops.sum(ops.exp(logits - top), axis=-1, keepdims=True))


class _OneTokenPerRow:
    """Greedy search and sampling: each row chooses one token a step (`choose`)."""

    beams = 1

    def start(self, settings, prompts, lengths, uniforms):
        batch = ops.shape(prompts)[0]
        tokens = ops.concatenate(
            [prompts, ops.full((batch, settings.max_length), settings.pad_id, "int32")], axis=1)
        return tokens, ops.zeros((batch,), "bool"), ops.zeros((batch,), "float32")

    def feed(self, state, i):
        return ops.slice(state[0], (0, i), (ops.shape(state[0])[0], 1))

    def running(self, settings, state):
        return ops.logical_not(ops.all(state[1]))

    def advance(self, settings, state, position, logits, suppress, context):
        tokens, finished, scores = state
        lengths, uniforms = context
        batch = ops.shape(tokens)[0]
        uniform = None if uniforms is None else ops.slice(uniforms, (0, position), (batch, 1))
        chosen = self.choose(logits, uniform, suppress)
        in_prompt = position < lengths
        new = ops.logical_and(ops.logical_not(in_prompt), ops.logical_not(finished))
        if settings.scored:
            picked = ops.take_along_axis(logits, chosen[:, None], axis=-1)
            scores = scores + ops.where(new, _log_probs_at(logits, picked)[:, 0], 0.0)
        own = ops.slice(tokens, (0, position), (batch, 1))[:, 0]
        token = ops.where(in_prompt, own, ops.where(finished, settings.pad_id, chosen))
        ended = ops.logical_and(new, ops.equal(chosen, settings.end_id))
        finished = ops.logical_or(ops.logical_or(finished, ended),
                                  position + 1 >= lengths + settings.max_length)
        tokens = ops.slice_update(tokens, (0, position), token[:, None])
        return (tokens, finished, scores), None

    def finish(self, settings, state, steps, context):
        lengths = context[0]
        positions = lengths[:, None] + ops.arange(settings.max_length, dtype="int32")[None, :]
        return ops.take_along_axis(state[0], positions, axis=1), state[2]


@dataclasses.dataclass(frozen=True)
class Greedy(_OneTokenPerRow):
    """Greedy search: each row takes its most likely token."""

    def choose(self, logits, uniform, suppress):
        return argmax(logits)


@dataclasses.dataclass(frozen=True)
class Sample(_OneTokenPerRow):
    """Sampling: a draw from `softmax(logits / temperature)` restricted to the `top_k` most
    likely tokens and then to the nucleus (the smallest set of tokens whose probability reaches
    `top_p`, renormalised), by inverse transform of the step's uniform in [0, 1)."""

    temperature: float = 1.0
    top_k: object = None
    top_p: float = 1.0

    def choose(self, logits, uniform, suppress):
        vocab = logits.shape[-1]
        logits = suppress(logits / self.temperature)  # no temperature brings padding back
        if self.top_k == 1:
            return argmax(logits)
        order = None
        if self.top_k is not None or self.top_p < 1.0:
            logits, order = ops.top_k(logits, min(self.top_k or vocab, vocab))  # descending
        probs = ops.softmax(logits, axis=-1)
        if self.top_p < 1.0:  # keep a token while the more likely ones are below top_p
            before = ops.cumsum(probs, axis=-1) - probs
            probs = ops.where(before < self.top_p, probs, 0.0)
        cdf = ops.cumsum(probs, axis=-1)
        pick = ops.sum(ops.cast(cdf <= uniform * cdf[:, -1:], "int32"), axis=-1)
        pick = ops.minimum(pick, ops.shape(probs)[-1] - 1)[:, None]
        if order is not None:
            pick = ops.take_along_axis(order, pick, axis=-1)
        return ops.cast(pick[:, 0], "int32")


def _length_penalty(length, alpha):
    """((5 + length) / 6) ** alpha, the length penalty of Wu et al. (2016)."""
    return ops.power((5.0 + ops.cast(length, "float32")) / 6.0, alpha)


def _gather_beams(values, indices):
    """values (B, N, ...) gathered along the beam axis with indices (B, K)."""
    expanded = ops.reshape(indices, tuple(ops.shape(indices)) + (1,) * (len(values.shape) - 2))
    return ops.take_along_axis(values, expanded, axis=1)


def _beam_candidates(logits, alive_log_probs, count):
    """The `count` best continuations of each source, best first: `(B, count)` log-probabilities
    (a beam's plus its token's), beams and tokens, over every (beam, token) of `logits
    (B * k, vocab)` and `alive_log_probs (B, k)`. A beam's best continuations are its largest
    logits (a log-softmax shifts a row by one constant): only those are normalised and ranked."""
    batch, k = ops.shape(alive_log_probs)
    row_logits, row_tokens = top_k(logits, count)  # (B * k, count), sorted
    # (The row maximum is taken again, not sliced off `row_logits`: under XLA on the CPU that
    # slice made XLA sort whole rows instead of its top-k.)
    row_log_probs = ops.reshape(_log_probs_at(logits, row_logits), (batch, k, count))
    candidates = ops.reshape(alive_log_probs[:, :, None] + row_log_probs, (batch, k * count))
    top_log_probs, pick = ops.top_k(candidates, count)
    tokens = ops.take_along_axis(ops.reshape(row_tokens, (batch, k * count)), pick, axis=1)
    return top_log_probs, ops.cast(pick // count, "int32"), ops.cast(tokens, "int32")


@dataclasses.dataclass(frozen=True)
class Beam:
    """Beam search of `size` beams a source, ranking hypotheses by their log-probability
    divided by `_length_penalty(length, length_penalty)`. Row `b * size + j` is beam j of
    source b; the beams of a source share its cross-attention cache row."""

    size: int = 4
    length_penalty: float = 0.6

    @property
    def beams(self):
        return self.size

    def start(self, settings, prompts, lengths, uniforms):
        batch, k, length = ops.shape(prompts)[0] // self.size, self.size, settings.max_length + 1
        alive = ops.reshape(prompts, (batch, k, 1))
        alive = ops.concatenate(
            [alive, ops.full((batch, k, settings.max_length), settings.pad_id, "int32")], axis=2)
        # Only the first beam is alive at the start, so the first step expands one hypothesis.
        first = ops.concatenate([ops.zeros((1,)), ops.full((k - 1,), NEG_INF)], axis=0)
        alive_log_probs = ops.tile(ops.cast(first, "float32")[None], (batch, 1))
        lost = ops.full((batch, k), NEG_INF, "float32")
        return (alive, alive_log_probs, ops.full((batch, k, length), settings.pad_id, "int32"),
                lost, lost, ops.zeros((batch, k), "bool"))

    def feed(self, state, i):
        alive = state[0]
        batch, k = ops.shape(alive)[:2]
        return ops.reshape(ops.slice(alive, (0, 0, i), (batch, k, 1)), (batch * k, 1))

    def running(self, settings, state):
        # Stop once no alive beam can beat the worst kept finished hypothesis: log
        # probabilities only fall, and the penalty is at most the one of max_length.
        _, alive_log_probs, _, finished_scores, _, flags = state
        best_alive = alive_log_probs[:, 0] / _length_penalty(settings.max_length,
                                                             self.length_penalty)
        worst = ops.min(ops.where(flags, finished_scores, 0.0), axis=1)
        worst = ops.where(ops.any(flags, axis=1), worst, NEG_INF)
        return ops.logical_not(ops.all(ops.greater(worst, best_alive)))

    def advance(self, settings, state, position, logits, suppress, context):
        alive, alive_log_probs, finished_seq, finished_scores, finished_log_probs, flags = state
        batch, k, length = ops.shape(alive)
        # 2k candidates: even if k of them end here, k stay alive.
        top_log_probs, top_beam, top_token = _beam_candidates(logits, alive_log_probs, 2 * k)
        top_seq = _gather_beams(alive, top_beam)
        at = ops.equal(ops.arange(length, dtype="int32"), position)
        top_seq = ops.where(at[None, None, :], top_token[:, :, None], top_seq)
        ends = ops.equal(top_token, settings.end_id)

        alive_log_probs, alive_pick = ops.top_k(ops.where(ends, NEG_INF, top_log_probs), k)
        alive = _gather_beams(top_seq, alive_pick)
        offsets = ops.arange(batch, dtype="int32")[:, None] * k
        parent = ops.reshape(_gather_beams(top_beam, alive_pick) + offsets, (-1,))

        # Finished hypotheses are kept aside, ranked by their length-penalised score.
        new_scores = ops.where(
            ends, top_log_probs / _length_penalty(position, self.length_penalty), NEG_INF)
        finished_scores, pick = ops.top_k(ops.concatenate([finished_scores, new_scores], 1), k)
        finished_seq = _gather_beams(ops.concatenate([finished_seq, top_seq], axis=1), pick)
        finished_log_probs = _gather_beams(
            ops.concatenate([finished_log_probs, top_log_probs], axis=1), pick)
        flags = _gather_beams(ops.concatenate([flags, ends], axis=1), pick)
        return (alive, alive_log_probs, finished_seq, finished_scores, finished_log_probs,
                flags), parent

    def finish(self, settings, state, steps, context):
        alive, alive_log_probs, finished_seq, finished_scores, finished_log_probs, _ = state
        # The best alive beam (cut at max_length without <EOS>) competes with the best
        # finished hypothesis on the same length-penalised score; with none it wins outright.
        alive_score = alive_log_probs[:, 0] / _length_penalty(steps, self.length_penalty)
        take_alive = ops.greater(alive_score, finished_scores[:, 0])
        tokens = ops.where(take_alive[:, None], alive[:, 0], finished_seq[:, 0])
        scores = ops.where(take_alive, alive_log_probs[:, 0], finished_log_probs[:, 0])
        return tokens[:, 1:], scores


def search(decoder, settings, cache, prompts, lengths, uniforms=None):
    """Decode: tokens `(B, max_length)` (each row's new tokens, padding after its end) and
    scores `(B,)`.

    Args:
        decoder: has `call_with_cache(tokens, cache, index) -> (logits, cache)`.
        settings: `Settings`.
        cache: the decoder's empty cache, at least `P + max_length - 1` positions.
        prompts: int32 `(R, P)` right-padded prompts (beam search: `(B·size, 1)` start ids).
        lengths: int32 `(R,)`, each prompt's real tokens (≥ 1).
        uniforms: sampling's float32 draws `(R, P + max_length)`, one per position.
    """
    strategy = settings.strategy
    total = prompts.shape[1] + settings.max_length
    if prompts.shape[1] > 1:  # every prompt position but the last, in one pass
        _, cache = decoder.call_with_cache(prompts[:, :-1], cache, 0)
    state = strategy.start(settings, prompts, lengths, uniforms)
    context = (lengths, uniforms)  # constant over the loop
    if settings.suppress_pad:
        def suppress(logits):
            return suppress_token(logits, settings.pad_id, NEG_INF)
    else:
        def suppress(logits):
            return logits

    def cond(i, cache, state):
        return ops.logical_and(i + 1 < total, strategy.running(settings, state))

    def body(i, cache, state):
        logits, cache = decoder.call_with_cache(strategy.feed(state, i), cache, i)
        logits = suppress(ops.cast(logits[:, -1], "float32"))
        state, parent = strategy.advance(settings, state, i + 1, logits, suppress, context)
        if parent is not None:
            cache = dict(cache, self=reorder_beams(cache["self"], parent, i + 1))
        return i + 1, cache, state

    first = ops.cast(ops.min(lengths) - 1, "int32")
    steps, _, state = ops.while_loop(cond, body, (first, cache, state),
                                     maximum_iterations=total - 1)
    return strategy.finish(settings, state, steps, context)


_COMPILED = weakref.WeakKeyDictionary()  # model -> (its variables' ids, {key: compiled})


def compiles_per_shape(rows, static_shapes=False):
    """Whether a search of `rows` rows (sources × beams) is compiled once per input shape:
    always under JAX (jit); under TensorFlow from `XLA_ROWS` rows (XLA), and always with
    `static_shapes`; never under PyTorch (eager)."""
    backend = keras.backend.backend()
    return backend == "jax" or (backend == "tensorflow" and (static_shapes or rows >= XLA_ROWS))


def compiled(model, key, function, beams=1, static_shapes=False):
    """`function(*inputs, **constants)` compiled once per model and `key` (`MAX_COMPILED`
    kept): JAX's jit with the variables passed in (weight updates seen; a trace per input
    shape; XLA's `few_rows_options` for a few rows); TensorFlow's
    `tf.function` without AutoGraph, with XLA per input shape from `XLA_ROWS` rows (`beams` a
    source), else one graph of unknown dimensions (per shape with `static_shapes`); PyTorch
    eager with autograd off. Figures behind these choices: benchmarks/README.md."""
    variables = tuple(id(v) for v in model.variables)  # `quantize` replaces them
    held = _COMPILED.get(model)
    if held is None or held[0] != variables:
        held = _COMPILED[model] = (variables, {})
    run = held[1].pop(key, None) or _compile(model, function, beams, static_shapes)
    held[1][key] = run  # the most recently used last
    while len(held[1]) > MAX_COMPILED:
        del held[1][next(iter(held[1]))]
    return run


def _compile(model, function, beams, static_shapes):
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        variables = list(model.variables)
        quantized = quantized_variables(variables)
        functions = {}  # XLA's options (`few_rows_options`) -> the jitted search

        def stateless(values, *inputs, **constants):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return function(*inputs, **constants)

        def run(*inputs, **constants):
            options = few_rows_options(inputs[0].shape[0] * beams, quantized)
            key = None if options is None else tuple(options.items())
            if key not in functions:
                functions[key] = jax.jit(stateless, compiler_options=options)
            return functions[key]([v.value for v in variables], *inputs, **constants)

        return run
    if backend == "tensorflow":
        import tensorflow as tf

        if static_shapes:
            return tf.function(function, autograph=False)
        functions = {}  # with XLA or not -> its tf.function

        def run(*inputs):
            xla = compiles_per_shape(inputs[0].shape[0] * beams)
            if xla not in functions:
                functions[xla] = tf.function(function, autograph=False, jit_compile=True) if (
                    xla) else tf.function(function, autograph=False, input_signature=[
                        tf.TensorSpec([None] * len(x.shape), x.dtype) for x in inputs])
            return functions[xla](*inputs)

        return run
    if backend == "torch":
        import torch

        def run(*inputs):
            with torch.no_grad():
                return function(*inputs)

        return run
    return function


def uniforms(seed, rows, steps):
    """float32 uniforms in [0, 1) `(rows, steps)` from a NumPy generator: the draws of sampling
    are inputs of the compiled search, the same for a seed on every backend."""
    return np.random.default_rng(seed).random((rows, steps), dtype=np.float32)

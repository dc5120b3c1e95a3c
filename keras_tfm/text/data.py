"""Training batches of real text, one input pipeline for every backend (`keras.utils.PyDataset`).

* `read_pairs`: a file of sentence pairs (source TAB target, the manythings / Anki format).
* `TranslationBatches`: pairs of token ids grouped by length into a few padded shapes (so XLA
  and `tf.function` compile a handful of times), batches sized by a token budget or a sentence
  count, reshuffled every epoch.
* `LanguageModelWindows`: windows of a token stream with no padding, at random offsets (as
  nanoGPT samples them) or one after another (for evaluation).

`PyDataset` is plain Python and NumPy: no TensorFlow under JAX or PyTorch, the same batches on
every backend, and its cost is small beside a training step (benchmarks/README.md measures it).
"""

import math

import keras
import numpy as np

AUTO = "auto"
TOO_LONG = ("error", "truncate", "drop")


def read_pairs(path, skip_bad_lines=False):
    """Sentence pairs of a UTF-8 file, one pair a line: source TAB target (further TAB columns,
    such as manythings.org's attribution, are ignored).

    Args:
        path: the file.
        skip_bad_lines: skip lines without a TAB (or with an empty side) and count them,
            instead of raising.

    Returns:
        `(sources, targets, skipped)`: two lists of strings and the number of lines skipped.

    Raises:
        ValueError: the file is empty, is not UTF-8 (the line is named), or a line has no TAB
            or an empty side (its line number; unless `skip_bad_lines`).
    """
    with open(path, "rb") as file:
        raw = file.read()
    sources, targets, skipped = [], [], 0
    for number, line in enumerate(raw.splitlines(), 1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"{path}: line {number} is not UTF-8 ({error.reason} at byte "
                             f"{error.start}); save the file as UTF-8.") from None
        text = text.lstrip("\ufeff") if number == 1 else text
        if not text.strip():
            continue
        columns = text.split("\t")
        if len(columns) < 2 or not columns[0].strip() or not columns[1].strip():
            if skip_bad_lines:
                skipped += 1
                continue
            raise ValueError(f"{path}: line {number} is not 'source<TAB>target': {text[:80]!r} "
                             "(pass skip_bad_lines=True to skip such lines).")
        sources.append(columns[0].strip())
        targets.append(columns[1].strip())
    if not sources:
        raise ValueError(f"{path}: no sentence pairs (the file is empty"
                         f"{' or every line was skipped' if skipped else ''}).")
    return sources, targets, skipped


def _auto_buckets(lengths, count):
    """The `count` (or fewer) bucket lengths that pad the least: each length padded up to the
    smallest bucket that holds it, the last bucket the longest length (an exact dynamic program
    over the histogram of lengths)."""
    histogram = np.bincount(lengths)
    longest = len(histogram) - 1
    below = np.concatenate([[0], np.cumsum(histogram)])  # below[l]: lengths < l
    # best[k][b]: least padded size of the lengths <= b in k buckets, the last one b
    best = np.full((count + 1, longest + 1), np.inf)
    choice = np.zeros((count + 1, longest + 1), int)
    best[1] = below[1:] * np.arange(longest + 1)
    for k in range(2, count + 1):
        for b in range(1, longest + 1):
            costs = best[k - 1][:b] + (below[b + 1] - below[1:b + 1]) * b
            choice[k][b] = int(np.argmin(costs))
            best[k][b] = costs[choice[k][b]]
    k = int(np.argmin(best[1:, longest])) + 1  # (fewer buckets when more cannot pad less)
    buckets, b = [], longest
    while k >= 1 and b > 0:
        buckets.append(b)
        b, k = choice[k][b], k - 1
    return sorted(buckets)


class TranslationBatches(keras.utils.PyDataset):
    """Batches `((source, decoder_input), labels)` of sentence pairs for `model.fit`.

    Each pair goes to the shortest bucket that holds it (its source, and its target with the
    start or end token); every batch of a bucket has the same shape `(rows, length)` on all
    three arrays, so a compiled train step compiles once per bucket. Batches hold `max_tokens //
    length` rows (a token budget, fairseq's `max_tokens`) or `batch_size` rows; a bucket's last
    batch is filled up with rows of padding, which the masked loss skips. Every pair is in
    exactly one batch per epoch; the pairs of a bucket and the order of the batches are shuffled
    again at every epoch.

    The decoder input is `[start_id] + target` and the labels `target + [end_id]`, both padded
    with `pad_id`: train with `MaskedSparseCategoricalCrossentropy(pad_id=pad_id)`.

    Args:
        source_ids, target_ids: lists of token-id sequences (e.g. `Tokenizer.encode`), one
            pair per index; targets without start or end tokens.
        pad_id, start_id, end_id: the model's special ids.
        max_tokens: the token budget of a batch, `rows × length` (exclusive with
            `batch_size`).
        batch_size: rows a batch (exclusive with `max_tokens`).
        buckets: increasing bucket lengths, or "auto": the `num_buckets` lengths that pad the
            pairs the least (the last the longest pair).
        num_buckets: the number of "auto" buckets.
        max_length: the longest sequence the model takes (a learned position table); pairs
            longer than this are handled by `too_long`. None: no limit.
        too_long: `"error"` (the default: a ValueError saying how many pairs are too long),
            `"truncate"` (cut to `max_length`) or `"drop"`; `num_truncated` / `num_dropped`
            count them.
        shuffle: reshuffle every epoch (False: fixed order, by bucket).
        seed: the shuffling seed.
        **kwargs: `keras.utils.PyDataset` arguments (`workers`, `use_multiprocessing`, ...).

    Attributes:
        buckets: the bucket lengths.
        padding_fraction: the share of the batches' token positions (both sides) that are
            padding.
        fixed_padding_fraction: the same if every pair were padded to the longest one (what a
            single shape would cost).

    Example:

    >>> data = TranslationBatches([[5, 6], [7]], [[8], [9, 10, 11]], pad_id=0, start_id=1,
    ...                           end_id=2, batch_size=2)
    >>> (source, decoder_input), labels = data[0]
    >>> source.shape, decoder_input.shape
    ((2, 4), (2, 4))
    """

    def __init__(self, source_ids, target_ids, pad_id, start_id, end_id, max_tokens=None,
                 batch_size=None, buckets=AUTO, num_buckets=5, max_length=None,
                 too_long="error", shuffle=True, seed=None, **kwargs):
        super().__init__(**kwargs)
        if len(source_ids) != len(target_ids):
            raise ValueError(f"{len(source_ids)} sources but {len(target_ids)} targets.")
        if not len(source_ids):
            raise ValueError("TranslationBatches needs at least one sentence pair.")
        if (max_tokens is None) == (batch_size is None):
            raise ValueError("Give one of `max_tokens` (a token budget) or `batch_size`; "
                             f"received max_tokens={max_tokens!r}, batch_size={batch_size!r}.")
        if too_long not in TOO_LONG:
            raise ValueError(f"`too_long` must be one of {TOO_LONG}; received {too_long!r}.")
        self.pad_id, self.start_id, self.end_id = pad_id, start_id, end_id
        lengths = np.array([max(len(s), len(t) + 1) for s, t in zip(source_ids, target_ids)])
        keep = np.arange(len(lengths))
        self.num_truncated = self.num_dropped = 0
        if max_length is not None:
            over = lengths > max_length
            if over.any() and too_long == "error":
                raise ValueError(
                    f"{int(over.sum())} of {len(lengths)} pairs are longer than max_length="
                    f"{max_length} tokens (the longest: {int(lengths.max())}); pass "
                    'too_long="truncate" or "drop", or a larger max_length.')
            if too_long == "drop":
                keep, self.num_dropped = keep[~over], int(over.sum())
                if not len(keep):
                    raise ValueError(f"Every pair is longer than max_length={max_length}.")
            else:
                self.num_truncated = int(over.sum())
            lengths = np.minimum(lengths[keep], max_length)
        limit = max_length or int(lengths.max())
        self._sources = [np.asarray(source_ids[i][:limit], "int32") for i in keep]
        self._targets = [np.asarray(target_ids[i][:limit - 1], "int32") for i in keep]
        if isinstance(buckets, str) and buckets == AUTO:
            buckets = _auto_buckets(lengths, num_buckets)
        buckets = [int(b) for b in buckets]
        if buckets != sorted(set(buckets)) or buckets[0] < 1:
            raise ValueError(f"`buckets` must be increasing positive lengths; received {buckets}.")
        if buckets[-1] < lengths.max():
            raise ValueError(f"The longest pair ({int(lengths.max())} tokens) does not fit the "
                             f"largest bucket ({buckets[-1]}).")
        self.buckets = buckets
        self._bucket_of = np.searchsorted(buckets, lengths)
        self._rows = {}
        for b, length in enumerate(buckets):
            rows = batch_size or max_tokens // length
            if rows < 1:
                raise ValueError(f"max_tokens={max_tokens} cannot hold one sentence of the "
                                 f"bucket of {length} tokens; raise max_tokens.")
            self._rows[b] = rows
        self._rng = np.random.default_rng(seed)
        self.shuffle = shuffle
        self._batches = self._plan()
        real = sum(len(s) + len(t) + 1 for s, t in zip(self._sources, self._targets))
        positions = sum(2 * self._rows[b] * self.buckets[b] for b, _ in self._batches)
        self.padding_fraction = 1.0 - real / positions
        self.fixed_padding_fraction = 1.0 - real / (2 * len(self._sources) * int(lengths.max()))

    def _plan(self):
        """The epoch's batches: `(bucket, indices)` pairs."""
        batches = []
        for b in range(len(self.buckets)):
            members = np.flatnonzero(self._bucket_of == b)
            if self.shuffle:
                members = self._rng.permutation(members)
            rows = self._rows[b]
            batches += [(b, members[i:i + rows]) for i in range(0, len(members), rows)]
        if self.shuffle:
            batches = [batches[i] for i in self._rng.permutation(len(batches))]
        # Keras's TensorFlow pipeline fixes its shapes from the first two batches: two buckets
        # there leave the lengths open (one bucket twice would refuse every other length).
        other = next((i for i, (b, _) in enumerate(batches) if b != batches[0][0]), None)
        if other is not None:
            batches[1], batches[other] = batches[other], batches[1]
        return batches

    def __len__(self):
        return len(self._batches)

    def __getitem__(self, index):
        bucket, members = self._batches[index]
        rows, length = self._rows[bucket], self.buckets[bucket]
        source = np.full((rows, length), self.pad_id, "int32")
        decoder_input = np.full((rows, length), self.pad_id, "int32")
        labels = np.full((rows, length), self.pad_id, "int32")
        for row, i in enumerate(members):
            s, t = self._sources[i], self._targets[i]
            source[row, :len(s)] = s
            decoder_input[row, 0] = self.start_id
            decoder_input[row, 1:len(t) + 1] = t
            labels[row, :len(t)] = t
            labels[row, len(t)] = self.end_id
        return (source, decoder_input), labels

    def on_epoch_end(self):
        if self.shuffle:
            self._batches = self._plan()


class LanguageModelWindows(keras.utils.PyDataset):
    """Batches `(x, y)` of windows of a token stream for a language model: `x = ids[i:i+L]`,
    `y = ids[i+1:i+L+1]`, no padding (train with `pad_id=None` and a loss that counts every
    target, `MaskedSparseCategoricalCrossentropy(ignore_class=None)`).

    Args:
        token_ids: the token stream, a 1-D array of ids (e.g. a whole text encoded).
        sequence_length: L, the window (context) length.
        batch_size: windows a batch.
        steps: batches an epoch with `random=True` (None: as many as the stream holds windows
            of L, `len // (L * batch_size)`, at least 1).
        random: windows at random offsets, drawn afresh every epoch from `seed` (nanoGPT's
            sampling: `rng.integers(0, len(ids) - L, size=batch_size)` for each batch, so
            another program with the same generator draws the same windows); False:
            consecutive windows `0, L, 2L, …` covering the stream once, in order (for
            evaluation: every target counted once; a smaller last batch).
        seed: the seed of the offsets.
        **kwargs: `keras.utils.PyDataset` arguments.

    Example:

    >>> data = LanguageModelWindows(np.arange(100), sequence_length=8, batch_size=4, seed=0)
    >>> x, y = data[0]
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    ((4, 8), True)
    """

    def __init__(self, token_ids, sequence_length, batch_size, steps=None, random=True,
                 seed=None, **kwargs):
        super().__init__(**kwargs)
        self._ids = np.asarray(token_ids, "int32").reshape(-1)
        self.sequence_length, self.batch_size = int(sequence_length), int(batch_size)
        if len(self._ids) < self.sequence_length + 1:
            raise ValueError(f"The token stream ({len(self._ids)} ids) is shorter than one "
                             f"window of sequence_length={sequence_length} plus its target.")
        self.random = random
        if random:
            self.steps = steps or max(1, len(self._ids) // (self.sequence_length * batch_size))
            self._rng = np.random.default_rng(seed)
            self._draw()
        else:
            count = (len(self._ids) - 1) // self.sequence_length
            self._offsets = np.arange(count) * self.sequence_length
            self.steps = math.ceil(count / self.batch_size)

    def _draw(self):
        high = len(self._ids) - self.sequence_length
        self._offsets = self._rng.integers(0, high, size=(self.steps, self.batch_size))

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        if self.random:
            offsets = self._offsets[index]
        else:
            offsets = self._offsets[index * self.batch_size:(index + 1) * self.batch_size]
        windows = offsets[:, None] + np.arange(self.sequence_length + 1)
        tokens = self._ids[windows]
        return tokens[:, :-1], tokens[:, 1:]

    def on_epoch_end(self):
        if self.random:
            self._draw()

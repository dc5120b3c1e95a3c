"""The toy translation data of seed 003 ("Data Generation Strategy for Translation Tasks").

* Source language X: a vocabulary of 7 words mixing lower-case letters and digits 1–9 (never 0,
  so 10 − d is one digit), sampled with a different probability per word, random lengths.
* Target language Y, from X: reverse the sequence, capitalise letters, replace each digit d by
  10 − d, and make the first Y token depend on the last X token:
  `Y = [t(x_last)] + reversed(t(x))`.
* `<PAD>` (id 0), `<SOS>` (1) and `<EOS>` (2) in both vocabularies; sequences are wrapped in
  `<SOS> … <EOS>` and padded to a fixed length. Generated from a seed, no download.
"""

import numpy as np

import keras_tfm

PAD, SOS, EOS = 0, 1, 2
SPECIALS = ["<PAD>", "<SOS>", "<EOS>"]
SOURCE_WORDS = ["a", "b", "c", "d", "3", "5", "8"]
WORD_PROBABILITIES = [0.25, 0.2, 0.15, 0.1, 0.12, 0.1, 0.08]
MIN_LENGTH, MAX_LENGTH = 5, 20


def translate_word(word):
    """t(w): letters are capitalised, a digit d becomes 10 − d."""
    return str(10 - int(word)) if word.isdigit() else word.upper()


TARGET_WORDS = [translate_word(w) for w in SOURCE_WORDS]
SOURCE_VOCAB = SPECIALS + SOURCE_WORDS
TARGET_VOCAB = SPECIALS + TARGET_WORDS
SOURCE_IDS = {w: i for i, w in enumerate(SOURCE_VOCAB)}
TARGET_IDS = {w: i for i, w in enumerate(TARGET_VOCAB)}
# <SOS> x <EOS> and <SOS> y <EOS>, with len(y) = len(x) + 1
SOURCE_LENGTH = MAX_LENGTH + 2
TARGET_LENGTH = MAX_LENGTH + 3


def translate(words):
    """Y from X: `[t(x_last)] + reversed(t(x))`."""
    translated = [translate_word(w) for w in words]
    return [translated[-1]] + translated[::-1]


def sample_sentences(num, seed=0, min_length=MIN_LENGTH, max_length=MAX_LENGTH):
    """`num` source sentences (lists of words) with random lengths and word frequencies."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_length, max_length + 1, num)
    return [list(rng.choice(SOURCE_WORDS, size=n, p=WORD_PROBABILITIES)) for n in lengths]


def encode(words, ids, length):
    tokens = [SOS] + [ids[w] for w in words] + [EOS]
    return tokens + [PAD] * (length - len(tokens))


def decode(tokens, vocab=TARGET_VOCAB):
    """Token ids to words, stopping at <EOS> and skipping <SOS>/<PAD>."""
    words = []
    for t in tokens:
        if t == EOS:
            break
        if t not in (PAD, SOS):
            words.append(vocab[t])
    return words


def make_dataset(num, seed=0):
    """Source tokens `(num, SOURCE_LENGTH)` and target tokens `(num, TARGET_LENGTH)` (int32),
    checked against their vocabularies (`keras_tfm.check_token_ids`).

    For teacher forcing: decoder inputs are `target[:, :-1]`, labels `target[:, 1:]`."""
    sentences = sample_sentences(num, seed)
    source = [encode(s, SOURCE_IDS, SOURCE_LENGTH) for s in sentences]
    target = [encode(translate(s), TARGET_IDS, TARGET_LENGTH) for s in sentences]
    return (keras_tfm.check_token_ids(source, len(SOURCE_VOCAB), name="source"),
            keras_tfm.check_token_ids(target, len(TARGET_VOCAB), name="target"))

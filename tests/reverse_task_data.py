"""A small generated copy/reverse task for model tests (no download)."""

import numpy as np

PAD, SOS, EOS = 0, 1, 2


def reverse_task(num, vocab_size=12, min_len=3, max_len=7, seed=0):
    """Source: random tokens 3…vocab-1, right-padded; target: the reversed source.

    Returns encoder tokens (num, max_len), decoder inputs (num, max_len + 1) starting with SOS,
    and targets (num, max_len + 1) ending with EOS, all padded with 0."""
    rng = np.random.default_rng(seed)
    src = np.zeros((num, max_len), "int32")
    dec_in = np.zeros((num, max_len + 1), "int32")
    tgt = np.zeros((num, max_len + 1), "int32")
    for i in range(num):
        n = rng.integers(min_len, max_len + 1)
        seq = rng.integers(3, vocab_size, n)
        src[i, :n] = seq
        out = seq[::-1]
        dec_in[i, 0], dec_in[i, 1:n + 1] = SOS, out
        tgt[i, :n], tgt[i, n] = out, EOS
    return src, dec_in, tgt

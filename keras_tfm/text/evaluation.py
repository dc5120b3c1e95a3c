"""Translation quality as users measure it: sacrebleu's corpus BLEU and chrF, and a Keras
callback that puts them into the epoch logs and keeps the best model by them."""

import math

import keras


def _sacrebleu():
    try:
        import sacrebleu
    except ImportError as error:  # an optional dependency: the `text` extra
        raise ImportError('Translation scores need `sacrebleu`: pip install "keras-tfm[text]".'
                          ) from error
    return sacrebleu


def corpus_scores(hypotheses, references):
    """Corpus BLEU and chrF (sacrebleu's defaults: 13a tokenization, chrF with n = 6) of
    `hypotheses` against one reference each.

    Args:
        hypotheses: a list of strings (the translations).
        references: a list of strings, one per hypothesis.

    Returns:
        `{"bleu": float, "chrf": float}`, both in [0, 100].

    Raises:
        ValueError: the lists differ in length or are empty.

    Example:

    >>> corpus_scores(["the cat sat on the mat"], ["the cat sat on the mat"])["bleu"]
    100.00000000000004
    """
    if len(hypotheses) != len(references) or not len(references):
        raise ValueError(f"Need as many hypotheses as references, at least one; received "
                         f"{len(hypotheses)} and {len(references)}.")
    sacrebleu = _sacrebleu()
    hypotheses, references = list(hypotheses), [list(references)]
    return {"bleu": sacrebleu.corpus_bleu(hypotheses, references).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, references).score}


class TranslationScores(keras.callbacks.Callback):
    """Validation BLEU and chrF at the end of every `every`-th epoch, written into the epoch's
    logs as `val_bleu` and `val_chrf` (so they show in the progress bar, in `History` and in a
    `CSVLogger` or `ModelCheckpoint` listed after this callback), and the best translator
    saved by `monitor`.

    Args:
        translator: a `keras_tfm.text.Translator` around the model being trained.
        sources: validation source sentences (strings).
        references: their reference translations.
        every: score every `every` epochs (and after the last one, `on_train_end`, if the
            last epoch was skipped).
        filepath: a directory: the translator is saved there (`Translator.save`) whenever
            `monitor` improves. None: nothing is saved.
        monitor: `"val_bleu"` or `"val_chrf"`.
        **translate_kwargs: passed to the translator (`beam_size`, `batch_size`, ...).

    Attributes:
        best: the best `monitor` value so far (-inf before the first score).
        history: one `{"epoch", "val_bleu", "val_chrf"}` dict per scoring.

    Example:

    >>> callback = TranslationScores(translator, val_sources, val_references,
    ...                              filepath="best_model")  # doctest: +SKIP
    >>> model.fit(batches, epochs=10, callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(self, translator, sources, references, every=1, filepath=None,
                 monitor="val_bleu", **translate_kwargs):
        super().__init__()
        if monitor not in ("val_bleu", "val_chrf"):
            raise ValueError(f'`monitor` must be "val_bleu" or "val_chrf"; received {monitor!r}.')
        if len(sources) != len(references) or not len(sources):
            raise ValueError(f"Need as many references as sources, at least one; received "
                             f"{len(sources)} and {len(references)}.")
        self.translator, self.sources, self.references = translator, list(sources), list(references)
        self.every, self.filepath, self.monitor = int(every), filepath, monitor
        self.translate_kwargs = translate_kwargs
        self.best, self.history, self._scored_epoch = -math.inf, [], None

    def score(self):
        """`{"val_bleu", "val_chrf"}` of the translator on the validation set now."""
        scores = corpus_scores(self.translator(self.sources, **self.translate_kwargs),
                               self.references)
        return {"val_bleu": scores["bleu"], "val_chrf": scores["chrf"]}

    def _score_epoch(self, epoch, logs):
        scores = self.score()
        logs.update(scores)
        self.history.append({"epoch": epoch, **scores})
        self._scored_epoch = epoch
        if scores[self.monitor] > self.best:
            self.best = scores[self.monitor]
            if self.filepath is not None:
                self.translator.save(self.filepath, overwrite=True)
        return scores

    def on_epoch_end(self, epoch, logs=None):
        self._last_epoch = epoch
        if (epoch + 1) % self.every == 0:
            self._score_epoch(epoch, logs if logs is not None else {})

    def on_train_end(self, logs=None):
        last = getattr(self, "_last_epoch", None)
        if last is not None and self._scored_epoch != last:
            self._score_epoch(last, {})


"""Masked loss for sequence-to-sequence training."""

import keras
from keras import ops

from keras_tfm import masks as masks_lib
from keras_tfm._checks import in_vocabulary


def _scale_for_replicas(loss):
    """Divide by the replicas of a `tf.distribute` strategy, as Keras's own losses do.

    Under `tf.distribute` each replica computes the loss of its share of the batch and the
    gradients are summed across replicas, so Keras scales each replica's loss by
    1 / num_replicas (and unscales the reported value). Our own reduction must do the same,
    or gradients and reported losses come out num_replicas times too large. The result is the
    mean over replicas of each replica's per-token mean: the global per-token mean when the
    replicas hold equally many real tokens. Other backends and single-replica runs: unchanged.
    """
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            loss = loss / replicas
    return loss


@keras.saving.register_keras_serializable(package="keras_tfm")
class MaskedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Sparse categorical cross-entropy averaged over real target tokens only.

    Target tokens equal to `ignore_class` (padding) contribute nothing, and the mean is taken
    over the remaining tokens: `sum(loss · w) / sum(w)` with `w = (y_true != ignore_class)`
    (times `sample_weight` if given). The Keras mask that the model propagates to its logits
    (the decoder inputs' padding) is deliberately not applied on top: Keras would otherwise
    re-weight the already-masked mean a second time.

    A target id outside `[0, V)` that is not `ignore_class` (e.g. another library's padding
    -100) makes the loss NaN on every backend, never a finite number.

    Label smoothing for sparse targets: the target distribution is
    `(1 − ε) · one_hot(y) + ε / V` over the V classes.

    Args:
        from_logits: whether `y_pred` are logits (True) or probabilities.
        ignore_class: the target id to ignore (padding); None ignores nothing.
        pad_id: the same, named as the models name it (`model.special_ids["pad_id"]`; a
            MarianMT model pads with its last id, not 0).
        label_smoothing: ε in [0, 1).
        name: loss name.

    Call arguments:
        y_true: int `(B, T)`.
        y_pred: `(B, T, V)` logits or probabilities.
        sample_weight: optional `(B,)` or `(B, T)`.

    Returns:
        A scalar: the mean loss per real target token.
    """

    def __init__(self, from_logits=True, ignore_class=0, label_smoothing=0.0,
                 name="masked_sparse_categorical_crossentropy", pad_id=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"`label_smoothing` must be in [0, 1); received {label_smoothing!r}.")
        self.from_logits = bool(from_logits)
        self.ignore_class = masks_lib.ignored_target_id(ignore_class, pad_id)
        self.label_smoothing = float(label_smoothing)

    def call(self, y_true, y_pred):
        """Per-token losses `(B, T)` (ignored tokens included: weight them out)."""
        y_pred = ops.cast(y_pred, "float32")
        if self.from_logits:
            log_probs = ops.log_softmax(y_pred, axis=-1)
        else:
            log_probs = ops.log(ops.clip(y_pred, 1e-7, 1.0))
        labels = ops.cast(y_true, "int32")
        if self.ignore_class is not None:
            labels = ops.where(ops.equal(labels, self.ignore_class), 0, labels)
        # A target outside the vocabulary (e.g. another library's -100 padding) gives NaN, so
        # that the mean loss cannot come out finite.
        valid = in_vocabulary(labels, ops.shape(log_probs)[-1])
        labels = ops.where(valid, labels, 0)
        target_log_prob = ops.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
        if self.label_smoothing == 0.0:
            losses = -target_log_prob
        else:
            eps = self.label_smoothing
            losses = -(1.0 - eps) * target_log_prob - eps * ops.mean(log_probs, axis=-1)
        return ops.where(valid, losses, float("nan"))

    def __call__(self, y_true, y_pred, sample_weight=None):
        losses = self.call(y_true, y_pred)
        weights = masks_lib.target_weights(y_true, self.ignore_class, sample_weight)
        loss = ops.divide_no_nan(ops.sum(losses * weights), ops.sum(weights))
        return _scale_for_replicas(loss)

    def get_config(self):
        config = super().get_config()
        config.pop("reduction", None)
        return config | {
            "from_logits": self.from_logits,
            "ignore_class": self.ignore_class,
            "label_smoothing": self.label_smoothing,
        }

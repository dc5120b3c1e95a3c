"""Token accuracy over real (non-padding) target tokens."""

import keras
from keras import ops

from keras_tfm import masks as masks_lib


@keras.saving.register_keras_serializable(package="keras_tfm")
class MaskedAccuracy(keras.metrics.Metric):
    """Fraction of real target tokens whose arg-max prediction is right.

    Tokens equal to `ignore_class` (padding) are not counted.

    Args:
        ignore_class: the target id to skip; None counts every token.
        pad_id: the same, named as the models name it (`model.special_ids["pad_id"]`).
        name, dtype: metric name and dtype.

    Call arguments (`update_state`):
        y_true: int `(B, T)`; y_pred: `(B, T, V)` logits or probabilities;
        sample_weight: optional `(B,)` or `(B, T)`.
    """

    def __init__(self, ignore_class=0, name="masked_accuracy", dtype="float32", pad_id=None):
        super().__init__(name=name, dtype=dtype)
        self.ignore_class = masks_lib.ignored_target_id(ignore_class, pad_id)
        self.correct = self.add_variable((), initializer="zeros", dtype="float32", name="correct")
        self.count = self.add_variable((), initializer="zeros", dtype="float32", name="count")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_true = ops.cast(y_true, "int32")
        predicted = ops.cast(ops.argmax(y_pred, axis=-1), "int32")
        weights = masks_lib.target_weights(y_true, self.ignore_class, sample_weight)
        hits = ops.cast(ops.equal(predicted, y_true), "float32") * weights
        self.correct.assign_add(ops.sum(hits))
        self.count.assign_add(ops.sum(weights))

    def result(self):
        return ops.divide_no_nan(self.correct, self.count)

    def reset_state(self):
        self.correct.assign(0.0)
        self.count.assign(0.0)

    def get_config(self):
        return super().get_config() | {"ignore_class": self.ignore_class}

"""The learning-rate schedule of "Attention Is All You Need"."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="keras_tfm")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`lr = scale · d_model^−0.5 · min(step^−0.5, step · warmup_steps^−1.5)`.

    Linear warm-up for `warmup_steps` steps, then decay as `1/√step`; the peak, at
    `step = warmup_steps`, is `scale · (d_model · warmup_steps)^−0.5`. Keras counts optimizer
    iterations from 0 and the paper counts steps from 1, so iteration `i` uses `step = i + 1`.
    The default warm-up suits the paper's 100,000-step runs; a job of a few hundred steps needs
    a warm-up of about its length (README, "Picking the schedule for a small job").

    Args:
        d_model: the model width.
        warmup_steps: length of the warm-up.
        scale: a factor on the whole schedule.

    Example:

    >>> optimizer = keras.optimizers.Adam(TransformerSchedule(d_model=512), beta_2=0.98,
    ...                                   epsilon=1e-9)
    """

    def __init__(self, d_model, warmup_steps=4000, scale=1.0):
        if d_model <= 0 or warmup_steps <= 0:
            raise ValueError("`d_model` and `warmup_steps` must be positive; received "
                             f"d_model={d_model!r}, warmup_steps={warmup_steps!r}.")
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = float(scale)

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        warmup = float(self.warmup_steps)
        factor = ops.minimum(ops.rsqrt(step), step * warmup ** -1.5)
        return self.scale * float(self.d_model) ** -0.5 * factor

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}

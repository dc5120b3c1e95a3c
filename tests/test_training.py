"""Masked loss, masked accuracy and the transformer learning-rate schedule."""

import keras
import numpy as np
import pytest

from helpers import jit_options, to_np
from keras_tfm import (MaskedAccuracy, MaskedSparseCategoricalCrossentropy, TransformerSchedule,
                       build_transformer)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hand_loss(y_true, logits, smoothing=0.0, ignore=0):
    logp = np_log_softmax(logits.astype("float64"))
    nll = -np.take_along_axis(logp, y_true[..., None], -1)[..., 0]
    per_token = (1 - smoothing) * nll - smoothing * logp.mean(-1)
    real = y_true != ignore
    return per_token[real].mean()


def test_loss_is_the_mean_over_real_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 7)).astype("float32")
    y = np.array([[1, 2, 3, 0, 0], [4, 0, 0, 0, 0], [5, 6, 1, 2, 3]])
    loss = MaskedSparseCategoricalCrossentropy()
    np.testing.assert_allclose(float(to_np(loss(y, logits))), hand_loss(y, logits), rtol=1e-5)
    smoothed = MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)
    np.testing.assert_allclose(float(to_np(smoothed(y, logits))), hand_loss(y, logits, 0.1),
                               rtol=1e-5)
    probs = to_np(keras.ops.softmax(logits))
    from_probs = MaskedSparseCategoricalCrossentropy(from_logits=False)
    np.testing.assert_allclose(float(to_np(from_probs(y, probs))), hand_loss(y, logits), rtol=1e-4)
    # sample weights scale tokens: weighting sequence 1 by 0 removes it from the mean
    weighted = float(to_np(loss(y, logits, sample_weight=np.array([1.0, 0.0, 1.0]))))
    np.testing.assert_allclose(weighted, hand_loss(y[[0, 2]], logits[[0, 2]]), rtol=1e-5)
    with pytest.raises(ValueError, match="label_smoothing"):
        MaskedSparseCategoricalCrossentropy(label_smoothing=1.0)


def test_fit_reports_the_hand_computed_loss_on_a_padded_batch():
    # The decoder inputs are padded *more* than the targets, so the Keras mask propagated to the
    # logits differs from the targets' padding: if Keras re-weighted our loss by that mask, the
    # reported loss would be a mean over fewer tokens.
    model = build_transformer(20, 20, d_model=16, num_heads=2, ff_dim=32, num_encoder_layers=1,
                              num_decoder_layers=1, dropout=0.0)
    src = np.array([[3, 4, 5, 6], [7, 8, 0, 0]], "int32")
    dec_in = np.array([[1, 9, 0, 0, 0], [1, 0, 0, 0, 0]], "int32")
    target = np.array([[9, 10, 11, 2, 0], [12, 13, 2, 0, 0]], "int32")
    logits = to_np(model([src, dec_in]))
    expected = hand_loss(target, logits)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=MaskedSparseCategoricalCrossentropy(),
                  metrics=[MaskedAccuracy()], **jit_options())
    history = model.fit([src, dec_in], target, batch_size=2, epochs=1, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], expected, rtol=1e-4)
    evaluated = model.evaluate([src, dec_in], target, verbose=0, return_dict=True)
    np.testing.assert_allclose(evaluated["loss"], expected, rtol=1e-4)
    real = target != 0
    accuracy = (logits.argmax(-1) == target)[real].mean()
    np.testing.assert_allclose(evaluated["masked_accuracy"], accuracy, rtol=1e-6)


def test_masked_accuracy_counts_real_tokens_only():
    y = np.array([[1, 2, 0], [3, 0, 0]])
    logits = np.zeros((2, 3, 5), "float32")
    logits[0, 0, 1] = logits[0, 1, 4] = logits[1, 0, 3] = 1.0
    logits[0, 2, 0] = logits[1, 1, 0] = 5.0  # the padding would be "right": must not count
    metric = MaskedAccuracy()
    metric.update_state(y, logits)
    np.testing.assert_allclose(float(to_np(metric.result())), 2 / 3, rtol=1e-6)
    metric.update_state(y, logits, sample_weight=np.array([0.0, 1.0]))
    np.testing.assert_allclose(float(to_np(metric.result())), 3 / 4, rtol=1e-6)
    metric.reset_state()
    assert float(to_np(metric.result())) == 0.0
    restored = MaskedAccuracy.from_config(metric.get_config())
    assert restored.ignore_class == 0


def test_transformer_schedule_is_the_paper_formula():
    schedule = TransformerSchedule(d_model=512, warmup_steps=4000)
    for iteration in (0, 1, 999, 3999, 4000, 20000):
        step = iteration + 1  # Keras counts iterations from 0, the paper steps from 1
        expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
        np.testing.assert_allclose(float(to_np(schedule(iteration))), expected, rtol=1e-5)
    peak = float(to_np(schedule(3999)))
    np.testing.assert_allclose(peak, (512 * 4000) ** -0.5, rtol=1e-5)
    assert float(to_np(schedule(3998))) < peak > float(to_np(schedule(4001)))
    scaled = TransformerSchedule(d_model=512, warmup_steps=4000, scale=2.0)
    np.testing.assert_allclose(float(to_np(scaled(10))), 2 * float(to_np(schedule(10))), rtol=1e-6)
    config = keras.optimizers.schedules.serialize(scaled)
    restored = keras.optimizers.schedules.deserialize(config)
    assert isinstance(restored, TransformerSchedule) and restored.get_config() == scaled.get_config()
    with pytest.raises(ValueError, match="warmup_steps"):
        TransformerSchedule(d_model=512, warmup_steps=0)

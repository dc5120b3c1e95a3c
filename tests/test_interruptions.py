"""Processes killed half-way lose nothing: `fit` resumed by BackupAndRestore, atomic saves, and a
file saved under another backend trains compiled here (each worker runs in its own process)."""

import os
import signal
import subprocess
import sys

import keras
import numpy as np

from helpers import BACKEND, to_np
from keras_tfm import saving

sys.path.insert(0, os.path.dirname(__file__))
import interrupt_worker  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "interrupt_worker.py")


def run_worker(*args, backend=BACKEND):
    env = dict(os.environ, KERAS_BACKEND=backend)
    return subprocess.run([sys.executable, WORKER, *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=600)


def test_fit_killed_mid_epoch_resumes_to_the_same_weights_and_step(tmp_path):
    steps_per_epoch = 64 // interrupt_worker.BATCH
    backup, killed, resumed = tmp_path / "backup", tmp_path / "killed.npz", tmp_path / "out.npz"
    # SIGKILL after the 3rd batch of the second epoch: the last backup is the end of epoch 1.
    result = run_worker("fit", backup, steps_per_epoch + 2, killed)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert not killed.exists() and (backup / "latest.weights.h5").exists()
    result = run_worker("fit", backup, -1, resumed)
    assert result.returncode == 0, result.stderr[-3000:]

    model, (src, dec_in, tgt) = interrupt_worker.fit_model(jit_compile=BACKEND != "torch")
    model.fit([src, dec_in], tgt, batch_size=interrupt_worker.BATCH,
              epochs=interrupt_worker.EPOCHS, shuffle=False, verbose=0)
    expected, got = interrupt_worker.fit_result(model), np.load(resumed)
    assert int(got["iterations"]) == expected["iterations"] == (
        interrupt_worker.EPOCHS * steps_per_epoch)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_save_killed_half_way_keeps_the_good_file(tmp_path):
    target = tmp_path / "model.keras"
    inputs = keras.Input((4,))
    keras.Model(inputs, keras.layers.Dense(3)(inputs)).save(target)
    good = target.read_bytes()

    result = run_worker("save", target, "atomic")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert target.read_bytes() == good
    saving.load_model(target)

    # The same kill during a plain `model.save` leaves a broken file (what the rename avoids).
    result = run_worker("save", target, "plain")
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert target.read_bytes() != good
    try:
        saving.load_model(target)
    except ValueError as error:
        assert "not a .keras archive" in str(error)
    else:
        raise AssertionError("a half-written .keras file loaded")


def test_file_from_another_backend_gets_this_backends_jit_compile(tmp_path):
    """A file stores what jit_compile="auto" resolved to where it was saved (torch: False,
    JAX: True); load_model re-resolves it here unless told otherwise."""
    auto_here, (src, dec_in, tgt) = interrupt_worker.fit_model()  # jit_compile="auto" here
    other = "torch" if auto_here.jit_compile else "jax"  # a backend whose "auto" differs
    target = tmp_path / "model.keras"
    result = run_worker("save_here", target, backend=other)
    assert result.returncode == 0, result.stderr[-3000:]

    as_saved = keras.models.load_model(target)
    assert as_saved.jit_compile == (other == "jax")
    assert as_saved.jit_compile != auto_here.jit_compile  # the case the re-resolution is for
    loaded = saving.load_model(target)
    assert loaded.jit_compile == auto_here.jit_compile
    assert saving.load_model(target, jit_compile=None).jit_compile == as_saved.jit_compile
    assert saving.load_model(target, jit_compile=False).jit_compile is False
    # and it trains (compiled where this backend compiles)
    history = loaded.fit([src, dec_in], tgt, batch_size=16, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert int(to_np(loaded.optimizer.iterations)) == 4

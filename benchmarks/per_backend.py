"""The command line shared by the per-backend benchmarks (attention.py, dropout.py): one backend
in this process, or `--all` backends, each in its own process (Keras picks its backend at import),
results as JSON."""

import argparse
import json
import os
import subprocess
import sys

BACKENDS = ("jax", "tensorflow", "torch")


def device_name():
    """What the layers ran on: the accelerator's name, else "cpu"."""
    import keras

    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return "cpu" if device.platform == "cpu" else device.device_kind
    if backend == "torch":
        import torch

        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu"
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")


def main(run, doc, name, script):
    """`run(backend)` -> a JSON-able dict; `--all` writes results/<name>_<backend>.json."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--backend", choices=BACKENDS)
    parser.add_argument("--json")
    parser.add_argument("--all", action="store_true", help="every backend, one process each")
    parser.add_argument("--output-dir", default=os.path.join(os.path.dirname(script),
                                                             "results"))
    args = parser.parse_args()
    if args.all:
        os.makedirs(args.output_dir, exist_ok=True)
        for backend in BACKENDS:
            subprocess.run([sys.executable, script, "--backend", backend, "--json",
                            os.path.join(args.output_dir, f"{name}_{backend}.json")],
                           check=True)
        return
    if not args.backend:
        parser.error("--backend (or --all) is required")
    results = run(args.backend)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

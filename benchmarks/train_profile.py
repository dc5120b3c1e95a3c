"""Where a training step of nanoGPT's CPU run goes: a per-op profile of keras_tfm's language model
(`examples/text_lm.py`'s model and optimizer) on one backend, or of the plain-PyTorch GPT
(`torch_gpt.py`), on the same windows of Shakespeare.

    python benchmarks/train_profile.py --engine jax|tensorflow|torch|torch_gpt [--steps 30] \
        [--jit-compile auto|true|false]

Each engine trains `--warmup` steps, then `--steps` steps timed one by one (median ms a step,
the engine's own training call: `model.train_on_batch` or the plain loop's forward, backward,
clip and AdamW step), then `--steps` more under the engine's profiler: the torch profiler
(torch, torch_gpt: self time of each aten op) or the trace that `jax.profiler` /
`tf.profiler` write at host-tracer level 3 (every XLA thunk and TensorFlow op; read back with
TensorFlow's `xplane_pb2`). The profilers slow a step (TensorFlow's 2.5×): read their figures as
shares. Printed, in ms a step: the `--top` op kinds (a fusion's or op's name without its
number; TensorFlow's op type) summed over threads, then the `--top` single events.
Results: benchmarks/README.md.
"""

import argparse
import collections
import glob
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "examples")]
ENGINES = ("jax", "tensorflow", "torch", "torch_gpt")


def windows(steps, seed=0):
    """`steps` (x, y) batches of nanoGPT's random training windows (torch_gpt.py's data and
    draws), as int32 NumPy arrays, and the vocabulary size."""
    import numpy as np

    import torch_gpt

    train_ids, _, chars = torch_gpt.load_data(torch_gpt.DEFAULT_TEXT)
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        x, y = torch_gpt.windows(train_ids, torch_gpt.batch_offsets(rng, len(train_ids)))
        batches.append((x.numpy().astype("int32"), y.numpy().astype("int32")))
    return batches, len(chars)


def keras_step(vocab_size, jit_compile="auto"):
    """`step(x, y)` training keras_tfm's language model with text_lm.py's defaults (compiled
    again with `jit_compile` unless "auto")."""
    import text_lm

    args = text_lm.parse_args(["train", "--text", "-", "--out", "-"])
    model = text_lm.build_model(args, vocab_size)
    if jit_compile != "auto":
        model.compile(optimizer=model.optimizer, loss=model.loss, jit_compile=jit_compile)
    return lambda x, y: model.train_on_batch(x, y)


def torch_gpt_step(vocab_size):
    """`step(x, y)`: one iteration of torch_gpt.py's loop (constant learning rate)."""
    import torch

    import torch_gpt

    torch.manual_seed(0)
    model = torch_gpt.GPT(vocab_size, **torch_gpt.CONFIG).train()
    opt = torch_gpt.optimizer(model)

    def step(x, y):
        loss = torch_gpt.loss_fn(model, torch.as_tensor(x, dtype=torch.long),
                                 torch.as_tensor(y, dtype=torch.long))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def torch_profile(step, batches):
    """{op name: total ms} from the torch profiler (self CPU time of each aten op)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for x, y in batches:
            step(x, y)
    return {e.key: e.self_cpu_time_total / 1000 for e in prof.key_averages()}


def xplane_profile(step, batches, backend):
    """{op name: total ms}: the XLA (jax) or TensorFlow op events of the host trace."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with tempfile.TemporaryDirectory() as directory:
        if backend == "jax":
            import jax

            options = jax.profiler.ProfileOptions()
            options.host_tracer_level, options.python_tracer_level = 3, 0  # every thunk
            with jax.profiler.trace(directory, profiler_options=options):
                for x, y in batches:
                    step(x, y)
        else:
            import tensorflow as tf

            tf.profiler.experimental.start(directory, tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=3, python_tracer_level=0))
            for x, y in batches:
                step(x, y)
            tf.profiler.experimental.stop()
        path, = glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
    totals = collections.Counter()
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                totals[f"{line.name}: {name}"] += event.duration_ps / 1e9
    return dict(totals)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=ENGINES, required=True)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--jit-compile", choices=("auto", "true", "false"), default="auto",
                        help="Keras engines: auto keeps text_lm.py's choice (XLA under JAX "
                        "and TensorFlow, eager torch); true / false compile again with it "
                        "(true under torch: torch.compile)")
    args = parser.parse_args()
    backend = "torch" if args.engine == "torch_gpt" else args.engine
    os.environ["KERAS_BACKEND"] = backend
    batches, vocab_size = windows(args.warmup + 2 * args.steps)
    jit_compile = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    step = (torch_gpt_step(vocab_size) if args.engine == "torch_gpt"
            else keras_step(vocab_size, jit_compile))
    for x, y in batches[:args.warmup]:
        step(x, y)
    timed = batches[args.warmup:args.warmup + args.steps]
    seconds = []
    for x, y in timed:
        start = time.perf_counter()
        step(x, y)
        seconds.append(time.perf_counter() - start)
    ms = 1000 * statistics.median(seconds)
    profiled = batches[args.warmup + args.steps:]
    start = time.perf_counter()
    totals = (torch_profile(step, profiled) if backend == "torch"
              else xplane_profile(step, profiled, backend))
    wall = 1000 * (time.perf_counter() - start) / len(profiled)
    print(f"{args.engine}: {ms:.1f} ms a step (median of {args.steps}); profiled "
          f"{wall:.1f} ms a step; events sum to {sum(totals.values()) / len(profiled):.1f} ms "
          "a step (nested events counted in each)")
    kinds = collections.Counter()  # the kind of op or fusion: "thread: fusion.12" -> "fusion",
    for name, total in totals.items():  # TensorFlow's "scope/name:MatMul" -> "MatMul"
        event = name.split(": ", 1)[-1]
        op_type = re.search(r"(?<!:):([A-Z]\w*)$", event)  # (not C++'s "A::B")
        kinds[op_type.group(1) if op_type else re.sub(r"[._]\d+$", "", event)] += total
    for title, table in (("by kind (every thread)", kinds), ("by event", totals)):
        print(title)
        for name, total in sorted(table.items(), key=lambda item: -item[1])[:args.top]:
            print(f"{total / len(profiled):9.3f} ms  {name}")


if __name__ == "__main__":
    main()

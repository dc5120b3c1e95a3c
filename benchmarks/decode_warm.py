"""Warm `generate` calls of keras_tfm on an opus-mt-base-shaped MarianMT: two checkouts in turns.

    KERAS_BACKEND=torch python benchmarks/decode_warm.py --against /path/to/other/checkout

One worker process per checkout (PYTHONPATH picks its keras_tfm), both warm (compiled), asked
for one timed call at a time in turns, so that the machine's drift falls on both alike; the
model of `decode_peers.py` (random weights, written once to --model-dir); 32 new tokens forced;
cells `b1` (one 24-token source), `b4` (4 of them), `b16` (16), `beam` (one source, beam 4),
`s16` (32 sources of 5-60 tokens, `batch_size=16`) and `t128` (one source, 128 new tokens).
Prints each checkout's median seconds per cell over --rounds turns and the first one's time
÷ the other's (below 1: the first is faster). Without --against, the first alone.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

import decode_peers

CELLS = ("b1", "b4", "b16", "beam", "s16", "t128")


def worker(model_dir):
    """Answer "cell" lines on stdin with one timed call's seconds (the first call of a cell
    warms it up: compiles, not timed)."""
    import keras_tfm

    model = keras_tfm.from_marian(model_dir)
    pad, rng = model.special_ids["pad_id"], np.random.default_rng(0)

    def sources(n, longest, mixed=False):
        batch = np.full((n, longest), pad, "int32")
        for row in batch:
            length = rng.integers(5, longest + 1) if mixed else longest
            row[:length - 1] = rng.integers(2, pad, length - 1)
            row[length - 1] = 0  # </s>
        return batch

    one = sources(1, 24)
    cases = {"b1": dict(source_tokens=one), "b4": dict(source_tokens=sources(4, 24)),
             "b16": dict(source_tokens=sources(16, 24)), "beam": dict(source_tokens=one, method="beam", beam_size=4),
             "s16": dict(source_tokens=sources(32, 60, mixed=True), batch_size=16),
             "t128": dict(source_tokens=one, max_length=128)}
    warm = set()
    print(json.dumps({"file": keras_tfm.__file__}), flush=True)
    for line in sys.stdin:
        cell = line.strip()
        kwargs = dict(dict(max_length=32, end_id=None), **cases[cell])
        if cell not in warm:
            keras_tfm.generate(model, **kwargs)
            warm.add(cell)
        start = time.perf_counter()
        keras_tfm.generate(model, **kwargs)
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def _answer(process):
    """The worker's next JSON line (other lines it prints are passed on)."""
    while True:
        line = process.stdout.readline()
        if not line:
            raise RuntimeError("a worker stopped; see its error above")
        if line.startswith("{"):
            return json.loads(line)
        print(line, end="")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="/tmp/decode_warm_model")
    parser.add_argument("--against", help="the other keras_tfm checkout (its root)")
    parser.add_argument("--checkout", help="the first checkout instead of this one")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("cells", nargs="*", default=["b1", "b16", "s16"],
                        help=f"any of {', '.join(CELLS)}")
    args = parser.parse_args()
    if set(args.cells) - set(CELLS):
        parser.error(f"unknown cells {sorted(set(args.cells) - set(CELLS))}; cells: {CELLS}")
    if args.worker:
        return worker(args.model_dir)
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        decode_peers.write_model(args.model_dir, decode_peers.SHAPES["base"])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [os.path.abspath(args.checkout or here)] + ([os.path.abspath(args.against)] if args.against else [])
    workers = []
    for root in roots:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [root, os.path.dirname(os.path.abspath(__file__))]))
        process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--model-dir",
             args.model_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        print(root, "->", _answer(process)["file"], flush=True)
        workers.append(process)

    def ask(process, cell):
        process.stdin.write(cell + "\n")
        process.stdin.flush()
        return _answer(process)["seconds"]

    print(f"cell  {'  '.join(f'{r[-24:]:>24}' for r in roots)}  ratio", flush=True)
    for cell in args.cells:
        times = [[] for _ in workers]
        for turn in range(args.rounds):
            for k in (range(len(workers)) if turn % 2 == 0 else reversed(range(len(workers)))):
                times[k].append(ask(workers[k], cell))
        medians = [statistics.median(t) for t in times]
        ratio = f"{medians[0] / medians[1]:.3f}" if len(medians) == 2 else ""
        print(f"{cell:5} {'  '.join(f'{m:>22.3f} s' for m in medians)}  {ratio}", flush=True)
    for process in workers:
        process.stdin.close()
        process.wait()


if __name__ == "__main__":
    main()

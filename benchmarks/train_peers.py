"""Training speed beside plain PyTorch, two shapes, one invocation, a process per engine.

    python benchmarks/train_peers.py [--shapes gpt seq2seq] [--iters 2000] [--output FILE]

`gpt`: nanoGPT's CPU run on character-level Shakespeare (4 layers, 4 heads, width 128, context
64, batch 12, 2,000 iterations, AdamW, no dropout) through `shakespeare.py`'s engines: the
plain-PyTorch GPT `torch_gpt.py` and `examples/text_lm.py` under JAX, TensorFlow and PyTorch,
on the same windows and seeds. Reported per engine: ms a step after warm-up, the training wall
time, the validation loss, and the training time over the plain-PyTorch GPT's.

`seq2seq`: the paper's base model (width 512, 8 heads, feed-forward 2,048, 6 + 6 post-LN
layers, dropout 0.1, vocabulary 8,000) on short sentences (128 pairs padded to 32 tokens a
side, 4,096-token batches, lengths between half and all of it) through `train_throughput.py
--config paper_base`: keras_tfm's `build_transformer` + `fit` (Adam) under each backend, and
`torch.nn.Transformer` with a plain Adam loop in the torch process. Reported: ms a step (median
of rounds timed in turns) and keras_tfm's step over the plain loop's.

Results: results/train_peers.json (numbers, CPU, versions, date, command) and
benchmarks/README.md.
"""

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import shakespeare  # noqa: E402

SHAPES = ("gpt", "seq2seq")


def gpt(iters, text):
    """shakespeare.py's four engines, one process each: {engine: result}, ratios."""
    results = {}
    with tempfile.TemporaryDirectory() as work_dir:
        for engine in shakespeare.ENGINES:
            results[engine] = shakespeare.run_engine(engine, text, iters, work_dir)
    return {"results": results, "ratios": shakespeare.ratios(results)}


def seq2seq():
    """train_throughput.py's paper_base config under each backend, one process each (the
    plain torch.nn.Transformer loop in the torch one): {engine: ms a step}, ratios."""
    steps, extra = {}, {}
    with tempfile.TemporaryDirectory() as work_dir:
        for backend in shakespeare.BACKENDS:
            models = ["keras_tfm"] + (["torch_native"] if backend == "torch" else [])
            out = os.path.join(work_dir, f"{backend}.json")
            argv = [sys.executable, os.path.join(HERE, "train_throughput.py"), "--backend",
                    backend, "--config", "paper_base", "--models", *models, "--json", out]
            print("=== " + " ".join(shlex.quote(a) for a in argv), flush=True)
            subprocess.run(argv, check=True)
            with open(out) as f:
                result = json.load(f)
            for name, model in result["models"].items():
                engine = "torch_nn" if name == "torch_native" else backend
                steps[engine] = round(1000 * model["step_s"], 1)
                extra[engine] = {"params": model["params"]}
            if backend == "torch":
                extra["bound_ms"] = round(1000 * result["bound_s"], 1)
                extra["train_gflop"] = round(result["train_flops"] / 1e9, 1)
    ratios = {engine: round(ms / steps["torch_nn"], 3) for engine, ms in steps.items()}
    return {"ms_per_step": steps, "ratios": ratios, "details": extra}


def tables(record):
    """Markdown tables of a record (both shapes where present)."""
    out = []
    if "gpt" in record:
        out.append(shakespeare.table(record["gpt"]["results"], record["gpt"]["ratios"]))
    if "seq2seq" in record:
        s = record["seq2seq"]
        rows = ["| engine (paper base, 4,096-token batches) | ms a step | ÷ torch.nn.Transformer |",
                "|---|---|---|"]
        rows += [f"| {engine} | {ms:.0f} | {s['ratios'][engine]:.2f}× |"
                 for engine, ms in s["ms_per_step"].items()]
        out.append("\n".join(rows))
    return "\n\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--iters", type=int, default=2000, help="gpt: training iterations")
    parser.add_argument("--text", default=shakespeare.DEFAULT_TEXT)
    parser.add_argument("--output", default=os.path.join(HERE, "results", "train_peers.json"))
    args = parser.parse_args()
    record = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/train_peers.py"] + sys.argv[1:]),
              "cpu": shakespeare.cpu_name(), "cpus": os.cpu_count(),
              "versions": shakespeare.versions()}
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    for shape in args.shapes:  # the record written after each shape
        record[shape] = gpt(args.iters, os.path.abspath(args.text)) if shape == "gpt" \
            else seq2seq()
        with open(args.output, "w") as f:
            json.dump(record, f, indent=1)
    print(tables(record))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""nanoGPT's CPU run on character-level Shakespeare: the plain-PyTorch GPT (`torch_gpt.py`)
and keras_tfm's language model (`examples/text_lm.py`) under JAX, TensorFlow and PyTorch.

    python benchmarks/shakespeare.py [--text FILE] [--iters 2000] \
        [--engines torch_gpt jax tensorflow torch] [--work-dir DIR] [--output FILE]

One engine at a time, each in its own process (never two at once: 2 cores):
`python benchmarks/torch_gpt.py --text FILE --iters N`, then for each backend
`KERAS_BACKEND=<b> python examples/text_lm.py train --text FILE --out WORK_DIR/lm_<b> --iters N`.
Both train nanoGPT's CPU configuration (4 layers, 4 heads, width 128, context 64, batch 12,
AdamW with warm-up and cosine decay, no dropout) on the first 90% of the characters. Measured
per engine: the wall time of the whole process; from its output, `train_seconds=` (the
training loop's wall time) and `ms_per_step=` where it prints them, and `val_loss=` from its last
line (mean per-token cross-entropy on the last 10%, non-overlapping 64-character windows).
Printed: a markdown table with each engine's training time over the plain-PyTorch GPT's;
written: results/shakespeare.json (numbers, CPU, versions, date, command).
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_TEXT = os.path.join(os.path.dirname(REPO), "shared", "data", "tinyshakespeare",
                            "input.txt")
BACKENDS = ("jax", "tensorflow", "torch")
ENGINES = ("torch_gpt",) + BACKENDS
REFERENCE = "torch_gpt"
PACKAGES = ("keras", "jax", "tensorflow", "torch")


def cpu_name():
    """The CPU's "model name" from /proc/cpuinfo (else what platform knows)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions():
    """Python's and the installed packages' versions (a package not installed is left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def command(engine, text, iters, work_dir):
    """(argv, extra environment) of one engine's process."""
    if engine == REFERENCE:
        return [sys.executable, os.path.join(HERE, "torch_gpt.py"), "--text", text,
                "--iters", str(iters)], {}
    return [sys.executable, os.path.join(REPO, "examples", "text_lm.py"), "train", "--text", text,
            "--out", os.path.join(work_dir, f"lm_{engine}"), "--iters", str(iters)], \
        {"KERAS_BACKEND": engine}


def value(lines, key):
    """The float of the last `key=<value>` line, else None."""
    for line in reversed(lines):
        match = re.fullmatch(rf"\s*{key}=(\S+)\s*", line)
        if match:
            try:
                return float(match.group(1))
            except ValueError:
                return None
    return None


def run_engine(engine, text, iters, work_dir):
    """Runs one engine's process (its output shown as it comes) and parses what it printed."""
    argv, env = command(engine, text, iters, work_dir)
    shown = " ".join(f"{k}={v}" for k, v in env.items()) + (" " if env else "")
    shown += " ".join(shlex.quote(a) for a in argv)
    print(f"=== {engine}: {shown}", flush=True)
    lines = []
    start = time.perf_counter()
    with subprocess.Popen(argv, env={**os.environ, **env}, cwd=REPO, stdout=subprocess.PIPE,
                          text=True, bufsize=1) as process:  # stderr goes straight through
        for line in process.stdout:
            print(f"[{engine}] {line}", end="", flush=True)
            lines.append(line.rstrip("\n"))
    wall = time.perf_counter() - start
    result = {"command": shown, "returncode": process.returncode,
              "process_seconds": round(wall, 2),
              "train_seconds": value(lines, "train_seconds"),
              "ms_per_step": value(lines, "ms_per_step"), "val_loss": None}
    last = next((line for line in reversed(lines) if line.strip()), "")
    if process.returncode == 0 and last.strip().startswith("val_loss="):
        result["val_loss"] = value([last], "val_loss")
    else:
        result["error"] = (f"exit status {process.returncode}, last line {last!r} "
                           "(expected val_loss=<value>)")
    return result


def ratios(results):
    """Each engine's training seconds (else process seconds) over the reference's."""
    out = {}
    ref = results.get(REFERENCE, {})
    for engine, r in results.items():
        row = {}
        for key in ("train_seconds", "process_seconds"):
            if r.get(key) and ref.get(key):
                row[key] = round(r[key] / ref[key], 3)
        out[engine] = row
    return out


def table(results, ratio):
    def num(x, fmt):
        return "–" if x is None else format(x, fmt)

    rows = ["| engine | process s | train s | ms/step | val_loss | train ÷ torch_gpt "
            "| process ÷ torch_gpt |", "|---|---|---|---|---|---|---|"]
    for engine, r in results.items():
        rows.append(f"| {engine} | {num(r['process_seconds'], '.1f')} "
                    f"| {num(r['train_seconds'], '.1f')} | {num(r['ms_per_step'], '.1f')} "
                    f"| {num(r['val_loss'], '.4f')} "
                    f"| {num(ratio[engine].get('train_seconds'), '.2f')}"
                    f"{'' if ratio[engine].get('train_seconds') is None else '×'} "
                    f"| {num(ratio[engine].get('process_seconds'), '.2f')}"
                    f"{'' if ratio[engine].get('process_seconds') is None else '×'} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--work-dir", help="where text_lm.py writes its models (default: a "
                        "temporary directory, removed at the end)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "shakespeare.json"))
    args = parser.parse_args()
    text = os.path.abspath(args.text)
    if not os.path.isfile(text):
        parser.error(f"--text: no file {text}")
    started = datetime.datetime.now().astimezone()
    results = {}
    with tempfile.TemporaryDirectory() as temporary:
        work_dir = os.path.abspath(args.work_dir or temporary)
        for engine in args.engines:
            results[engine] = run_engine(engine, text, args.iters, work_dir)
    ratio = ratios(results)
    print(table(results, ratio))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"date": started.isoformat(timespec="seconds"),
                   "command": " ".join(shlex.quote(a) for a in
                                       ["python", os.path.relpath(__file__, REPO)] + sys.argv[1:]),
                   "cpu": cpu_name(), "cpus": os.cpu_count(), "versions": versions(),
                   "text": text, "iters": args.iters, "reference": REFERENCE,
                   "results": results, "ratios": ratio}, f, indent=1)
    print(f"wrote {args.output}")
    failed = [e for e, r in results.items() if "error" in r]
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (see results[...]['error'])")


if __name__ == "__main__":
    main()

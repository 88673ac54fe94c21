"""Memory of encoding one long document: whole (the tokenizer's own ``encode``, what ``prepare``
did) against in proven pieces (``torchpp.data.docsplit``), each run in a fresh child process
that loads the tokenizer as ``prepare`` does; the ids must be equal.

A child resets its peak RSS (``/proc/self/clear_refs``) once the tokenizer and the text are
loaded, so the figure is what encoding adds: peak RSS during the encoding minus the RSS before.
CPU seconds are the child's own for the encoding alone. Runs alternate whole/pieces.

    python benchmarks/bench_docsplit.py --data corpus.jsonl --tokenizer DIR   # its longest document
    python benchmarks/bench_docsplit.py --quick   # a ~1 MB document of local text, a tokenizer trained here
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r"""
import hashlib, json, sys, time
import numpy as np
from torchpp.data.tokenizer import load_encoder

def status():
    f = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(f["VmRSS"].split()[0]) << 10, int(f["VmHWM"].split()[0]) << 10

mode, tokdir, docfile = sys.argv[1:4]
enc, _ = load_encoder(tokdir)
text = open(docfile, encoding="utf-8").read()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak RSS starts again from the RSS now
base = status()[0]
t0 = time.process_time()
if mode == "pieces":
    ids = enc.ids(text)
else:
    ids = np.asarray(enc.tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)
cpu = time.process_time() - t0
print(json.dumps({"mode": mode, "base": base, "peak": status()[1], "cpu_s": cpu, "tokens": len(ids),
                  "pieces": enc.pieces, "sha": hashlib.sha256(ids.tobytes()).hexdigest()}))
"""


def longest_document(jsonl: Path, column: str, out: Path) -> int:
    """Writes the JSONL's longest document's text to ``out``; returns its length in characters."""
    best, best_len = -1, -1
    with open(jsonl, "rb") as f:
        while True:
            pos = f.tell()
            line = f.readline()
            if not line:
                break
            if len(line) > best_len:
                best, best_len = pos, len(line)
    with open(jsonl, "rb") as f:
        f.seek(best)
        text = json.loads(f.readline())[column]
    out.write_text(text, encoding="utf-8")
    return len(text)


def run(mode: str, tokdir: Path, doc: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", CHILD, mode, str(tokdir), str(doc)], capture_output=True, text=True,
                       env=env, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"{mode}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, help="a JSONL corpus; its longest document is encoded")
    ap.add_argument("--tokenizer", type=Path, help="a HF tokenizer directory")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a ~1 MB document of local text, a tokenizer trained here")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        doc = Path(tmp) / "doc.txt"
        if a.quick or a.data is None:
            sys.path.insert(0, str(ROOT / "tests"))
            from tiny_hf import train_tokenizer

            a.tokenizer = Path(tmp) / "tok"
            train_tokenizer(a.tokenizer, vocab_size=1000)
            text = "".join(p.read_text() for p in sorted((ROOT / "torchpp").rglob("*.py")))
            doc.write_text((text * (1 + (1 << 20) // len(text)))[:1 << 20])
            chars, a.rounds = 1 << 20, 1
        else:
            chars = longest_document(a.data, a.text_column, doc)
        rounds = [run(m, a.tokenizer, doc) for _ in range(a.rounds) for m in ("whole", "pieces")]
    by = {m: [r for r in rounds if r["mode"] == m] for m in ("whole", "pieces")}
    if len({r["sha"] for r in rounds}) != 1 or len({r["tokens"] for r in rounds}) != 1:
        raise SystemExit(f"bench_docsplit: the pieces' ids differ from the whole document's: {rounds}")
    fig = {m: {"added_mib": statistics.median((r["peak"] - r["base"]) / 2 ** 20 for r in rs),
               "cpu_s": statistics.median(r["cpu_s"] for r in rs)} for m, rs in by.items()}
    tokens = rounds[0]["tokens"]
    print(f"one document of {chars:,} characters, {tokens:,} tokens ({by['pieces'][0]['pieces']} pieces); "
          f"ids equal")
    for m, f in fig.items():
        print(f"  {m:6s}: +{f['added_mib']:.1f} MiB while encoding, {f['cpu_s']:.2f} CPU s")
    print(f"memory {fig['pieces']['added_mib'] / fig['whole']['added_mib']:.3f}x, "
          f"CPU {fig['pieces']['cpu_s'] / fig['whole']['cpu_s']:.2f}x of encoding it whole")
    if a.json:
        a.json.write_text(json.dumps({"chars": chars, "tokens": tokens, "figures": fig, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

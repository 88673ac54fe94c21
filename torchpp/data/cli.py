"""`torchpp data prepare --data DIR_OR_FILES --tokenizer DIR --out corpus/`."""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

from .sources import SUFFIXES


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", nargs="+", required=True,
                   help=f"files ({', '.join(SUFFIXES)}), folders of them, or datasets save_to_disk folders")
    p.add_argument("--tokenizer", required=True,
                   help="a HF tokenizer directory (e.g. the model's), or 'bytes' for UTF-8 bytes as token ids")
    p.add_argument("--out", type=Path, default=Path("corpus"), help="the corpus directory (tokens.bin, offsets.bin, "
                                                                     "index.json)")
    p.add_argument("--text-column", default="text", help="the text column of tables and datasets")
    p.add_argument("--split", default=None, help="the split of a DatasetDict folder")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizing processes (default: the CPU count)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets

    from . import prepare_corpus
    from .base import DataError
    from .sources import discover

    if args.num_proc is not None and args.num_proc < 1:
        raise DataError(f"--num-proc: expected >= 1, got {args.num_proc}")
    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    inputs = discover(args.data, text_column=args.text_column, split=args.split)
    notes = ([f"skipped {len(inputs.skipped)} metadata .json file(s) without a '{args.text_column}' column: "
              f"{', '.join(p.name for p in inputs.skipped[:5])}"] if inputs.skipped else [])
    notes += [f"ignored {inputs.ignored} file(s) of other kinds"] if inputs.ignored else []
    print(f"torchpp data prepare: {len(inputs.sources)} source(s), {inputs.bytes / 1e6:,.1f} MB"
          + "".join(f"; {n}" for n in notes), flush=True)
    index = prepare_corpus(args.data, args.out, tokenizer=args.tokenizer, text_column=args.text_column,
                           split=args.split, num_proc=args.num_proc, progress=_progress, inputs=inputs)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(("\n" if sys.stdout.isatty() else "") + f"wrote {args.out}: {index.documents:,} documents, "
          f"{index.tokens:,} {index.dtype} tokens ({index.tokenizer.name}, vocabulary {index.tokenizer.vocab_size:,}) in {dt:.1f} s, "
          f"{index.tokens / dt:,.0f} tokens/s, peak RSS {peak:.0f} MiB", flush=True)
    return 0


def _progress(p) -> None:
    done = p.bytes_done / p.bytes_total if p.bytes_total else 1.0
    bar = "#" * int(30 * done)
    end = "\r" if sys.stdout.isatty() else "\n"
    print(f"[{bar:<30}] {100 * done:5.1f}%  {p.tokens:,} tokens  {p.tokens_per_s:,.0f} tokens/s  {p.seconds:.1f} s",
          end=end, flush=True)

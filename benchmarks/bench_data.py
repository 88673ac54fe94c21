"""Data pipeline figures, measured side by side on this machine.

1. Prepare speed: `torchpp data prepare` of a JSONL corpus of real local text (Python sources
   and docs found on this machine, one file per document; nothing downloaded) against a plain
   `datasets` run a user would write — `load_dataset("json")` then `.map(tokenizer, batched=True,
   num_proc=N)` — with the same byte-level BPE tokenizer (trained here with `tokenizers`) and
   the same processes, run alternately; the ratio of tokens/s (wall clock, and CPU seconds of
   the whole process tree, which the load of other work on the machine distorts less), and
   the peak memory of the prepare's whole process tree (PSS summed over the processes, sampled
   every 250 ms).
2. Per-rank data memory: a 2-stage pipeline (2 ranks) trains a small Llama-architecture model on
   the big corpus and on a 1 MB one; each rank's peak RSS (ru_maxrss) with the big corpus minus
   with the small one, and the seconds from the end of set-up (model built, data open) to the
   end of the first step.

    python benchmarks/bench_data.py            # 200 MB corpus, num_proc 2
    python benchmarks/bench_data.py --quick    # 4 MB vs 1 MB, one round (the test runs this)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".txt", ".rst", ".md")
BASELINE = r"""
import sys, time, datasets
from transformers import AutoTokenizer
datasets.disable_progress_bars()
src, tokdir, n, cache = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
t0 = time.perf_counter()
tok = AutoTokenizer.from_pretrained(tokdir)
ds = datasets.load_dataset("json", data_files=src, split="train", cache_dir=cache)
out = ds.map(lambda b: tok(b["text"]), batched=True, num_proc=n)
dt = time.perf_counter() - t0
tokens = sum(len(x) for b in out.select_columns(["input_ids"]).iter(batch_size=10000) for x in b["input_ids"])
print(f"RESULT {tokens + len(out)} {dt}")
"""


def local_text(target: int, out: Path, exclude: set[str] | None = None) -> tuple[int, int]:
    """A JSONL of local files' text (one document each) of at least ``target`` bytes; (bytes, docs)."""
    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(sysconfig.get_paths()["purelib"]).resolve(),
             Path("/usr/share/doc")]
    size = docs = 0
    with open(out, "w") as f:
        for root in roots:
            for p in sorted(root.rglob("*")):
                if size >= target:
                    return size, docs
                if p.suffix not in SUFFIXES or not p.is_file() or p.stat().st_size > 4 << 20:
                    continue
                try:
                    text = p.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if "\x00" in text or not text.strip() or (exclude and str(p) in exclude):
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                size += len(text.encode())
                docs += 1
    if size < target:
        raise SystemExit(f"bench_data: only {size} bytes of local text found, wanted {target}")
    return size, docs


def tokenizer(out: Path, sample: Path, vocab: int = 8000) -> None:
    """Byte-level BPE trained on the first 8 MB of ``sample``, saved as a HF tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def lines():
        seen = 0
        with open(sample) as f:
            for line in f:
                seen += len(line)
                if seen > 8 << 20:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines(), trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(str(out))


def _pss(pid: int) -> int:
    """A process's proportional set size from ``smaps_rollup`` (one line; the full ``smaps`` that
    psutil reads costs a sampler most of a core on a 2 GB process)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_peak(proc: subprocess.Popen) -> list[int]:
    """Samples the summed PSS of ``proc`` and its children (shared pages split between the
    processes that share them) until it exits; returns [peak bytes]."""
    import psutil

    peak = [0]

    def run():
        try:
            p = psutil.Process(proc.pid)
            while proc.poll() is None:
                total = sum(_pss(q.pid) for q in [p, *p.children(recursive=True)])
                peak[0] = max(peak[0], total)
                time.sleep(0.25)  # a sample of a 1 GB tree costs ~10 ms of a core the measured runs share
        except psutil.Error:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    proc.wait()
    t.join()
    return peak


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prepare_round(work: Path, src: Path, tok: Path, num_proc: int, name: str) -> dict:
    """One timed run of ours or the baseline (a fresh cache or output each time)."""
    scratch = Path(tempfile.mkdtemp(dir=work, prefix=f"{name}-"))
    if name == "plain":
        cmd = [sys.executable, "-c", BASELINE, str(src), str(tok), str(num_proc), str(scratch / "hf")]
    else:
        cmd = [sys.executable, "-m", "torchpp.cli", "data", "prepare", "--data", str(src), "--tokenizer", str(tok),
               "--out", str(scratch / "corpus"), "--num-proc", str(num_proc)]
    t0, cpu0 = time.perf_counter(), _children_cpu()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    peak = _tree_peak(proc)
    out, err = proc.communicate()
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if proc.returncode != 0:
        raise SystemExit(f"bench_data: {name} failed: {err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    if name == "plain":
        tokens, _ = out.split("RESULT ")[1].split()
        tokens = int(tokens)
    else:
        tokens = json.loads((scratch / "corpus" / "index.json").read_text())["tokens"]
    subprocess.run(["rm", "-rf", str(scratch / "hf")])
    return {"name": name, "tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tokens_per_s": tokens / wall,
            "peak_tree_pss": peak[0],
            "corpus": str(scratch / "corpus")}


def _children_cpu() -> float:
    """CPU seconds of every waited-for descendant (a prepare's pool workers are waited for by it)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RANK = r"""
import json, resource, sys
from torchpp.train import main
rc = main(sys.argv[2:])
print("PEAK " + json.dumps({"rank": int(__import__("os").environ["RANK"]),
      "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)
sys.exit(rc)
"""


def train_round(work: Path, model: Path, plan: Path, corpus: Path, steps: int, tag: str) -> list[dict]:
    """2 ranks train on ``corpus``; each rank's peak RSS and the first step's distance from set-up."""
    port, logs = _free_port(), work / f"logs-{tag}"
    args = ["--plan", str(plan), "--model", str(model), "--data", str(corpus), "--steps", str(steps), "--threads", "1",
            "--log-dir", str(logs), "--timeout-s", "120", "--no-output"]
    procs = [subprocess.Popen([sys.executable, "-c", RANK, "x", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port)}) for r in range(2)]
    peaks = []
    for p in procs:
        out, err = p.communicate(timeout=1200)
        if p.returncode != 0:
            raise SystemExit(f"bench_data: training on {corpus} failed: {err.strip().splitlines()[-1:]}")
        peaks.append(json.loads(out.split("PEAK ")[1].splitlines()[0]))
    events = [json.loads(line) for line in (logs / "metrics.jsonl").open()]
    start = next(e["time"] for e in events if e.get("event") == "start")
    first = next(e["time"] for e in events if e.get("step") == 1)
    for pk in peaks:
        pk["first_step_s"] = first - start
    return peaks


def tiny_model(out: Path, vocab: int) -> Path:
    import torch
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        tie_word_embeddings=False, eos_token_id=1)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(cfg).save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 MB vs 1 MB corpora, one round")
    ap.add_argument("--mb", type=float, default=200.0, help="the big corpus's size in MB of text")
    ap.add_argument("--num-proc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--train-repeats", type=int, default=2, help="training runs per corpus (the least peak counts)")
    ap.add_argument("--rounds", default="plain,torchpp,torchpp,plain", help="the order of the prepare runs")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="the big corpus already prepared (skips the prepare rounds; the memory part only)")
    ap.add_argument("--work", type=Path, default=None, help="keep files here (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    a = ap.parse_args(argv)
    mb, rounds, steps = (4.0, ["plain", "torchpp"], 8) if a.quick else (a.mb, a.rounds.split(","), a.steps)
    work = a.work or Path(tempfile.mkdtemp(prefix="bench_data-"))
    work.mkdir(parents=True, exist_ok=True)
    big, small = work / "big.jsonl", work / "small.jsonl"
    if not big.is_file():
        local_text(int(mb * 1e6), big)
    if not small.is_file():
        local_text(int(1e6), small)
    tok = work / "tok"
    if not (tok / "tokenizer.json").is_file():
        tokenizer(tok, big)
    print(f"corpus {big}: {big.stat().st_size / 1e6:.1f} MB of JSONL (local Python sources and docs); tokenizer: "
          f"byte-level BPE, 8000 tokens; num_proc {a.num_proc}", flush=True)
    res = [prepare_round(work, big, tok, a.num_proc, name) for name in rounds] if a.corpus is None else []
    for r in res:
        print(f"  {r['name']:<8} {r['tokens']:>12,} tokens  {r['wall_s']:7.1f} s  {r['tokens_per_s']:>10,.0f} tokens/s  "
              f"{r['cpu_s']:7.1f} CPU s  peak tree PSS {r['peak_tree_pss'] / 2**20:,.0f} MiB", flush=True)
    names = {r["name"] for r in res}
    ratio = cpu_ratio = peak = None
    if names == {"plain", "torchpp"}:
        rate = {n: sum(r["tokens"] for r in res if r["name"] == n) / sum(r["wall_s"] for r in res if r["name"] == n)
                for n in names}
        cpu = {n: sum(r["tokens"] for r in res if r["name"] == n) / sum(r["cpu_s"] for r in res if r["name"] == n)
               for n in names}
        ratio, cpu_ratio = rate["torchpp"] / rate["plain"], cpu["torchpp"] / cpu["plain"]
        print(f"prepare: torchpp / plain datasets.map tokens/s = {ratio:.3f} (wall), {cpu_ratio:.3f} (per CPU second)",
              flush=True)
    if "torchpp" in names:
        peak = max(r["peak_tree_pss"] for r in res if r["name"] == "torchpp")
        print(f"prepare: torchpp prepare peak tree PSS {peak / 2**20:,.0f} MiB", flush=True)
        big_corpus = Path(next(r["corpus"] for r in res if r["name"] == "torchpp"))
    elif a.corpus is not None:
        big_corpus = a.corpus
    else:
        raise SystemExit("bench_data: --rounds: expected at least one torchpp round, or --corpus")
    small_corpus = work / "small_corpus"
    if not (small_corpus / "index.json").is_file():
        subprocess.run([sys.executable, "-m", "torchpp.cli", "data", "prepare", "--data", str(small), "--tokenizer",
                        str(tok), "--out", str(small_corpus), "--num-proc", "1"], check=True, env=_env(),
                       stdout=subprocess.DEVNULL)
    model = tiny_model(work / "model", 8000)
    from torchpp.models.presets import load_config, model_info
    from torchpp.planner.simple import make_plan

    make_plan(model_info(load_config(str(model)), str(model)), seq_len=128, global_batch=8, num_microbatches=2,
              layer_ranges=[(0, 2), (2, 4)], group_sizes=[1, 1], schedule="1f1b").save(work / "plan.json")
    mem: dict[str, list[dict]] = {}
    for rep in range(1 if a.quick else a.train_repeats):  # peaks are maxima: the least of the repeats is the figure
        for tag, corpus in (("small", small_corpus), ("big", big_corpus)):
            got = train_round(work, model, work / "plan.json", corpus, steps, f"{tag}{rep}")
            mem[tag] = [min(x, y, key=lambda p: p["maxrss_kib"]) for x, y in zip(mem.get(tag, got), got)]
    diffs = [(b["maxrss_kib"] - s["maxrss_kib"]) / 1024 for s, b in zip(mem["small"], mem["big"])]
    for r, (s, b) in enumerate(zip(mem["small"], mem["big"])):
        print(f"  rank {r}: peak RSS {s['maxrss_kib'] / 1024:,.1f} MiB (1 MB corpus) / {b['maxrss_kib'] / 1024:,.1f} "
              f"MiB ({mb:g} MB corpus); first step {b['first_step_s']:.2f} s after set-up", flush=True)
    print(f"data memory: peak RSS with the {mb:g} MB corpus minus with the 1 MB one, per rank: "
          f"{', '.join(f'{d:+.1f}' for d in diffs)} MiB; first step {max(b['first_step_s'] for b in mem['big']):.2f} s "
          "after set-up", flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps({"mb": mb, "num_proc": a.num_proc, "prepare_rounds": res, "ratio": ratio,
                                     "cpu_ratio": cpu_ratio, "prepare_peak_tree_pss": peak, "train": mem, "rss_diff_mib": diffs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

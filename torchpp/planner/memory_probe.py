"""One memory-calibration span, run in its own process: ``python -m torchpp.planner.memory_probe``.

Builds only what a stage holding decoder layers [start, end) (plus the embedding and/or tail)
holds, runs one forward + backward + AdamW step on ``batch`` samples, and prints one JSON line
with the peak resident-set increase over the process's RSS before the model was built. The
peak is sampled with psutil from a background thread (torch releases the GIL in its kernels).
A fresh process per span keeps one span's allocator state out of the next span's figure.
"""
from __future__ import annotations

import argparse
import json
import threading
import time


class PeakRSS:
    """Samples this process's RSS every ``interval`` seconds and keeps the maximum."""

    def __init__(self, interval: float = 0.0005):
        import psutil

        self.proc, self.interval = psutil.Process(), interval
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __enter__(self) -> "PeakRSS":
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = max(self.peak, self.proc.memory_info().rss)
        self._stop.set()
        self._t.join()


def run_span(model: str, start: int, end: int, has_embed: bool, has_tail: bool, batch: int, seq_len: int,
             threads: int = 1) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.presets import load_config, num_hidden_layers

    torch.set_num_threads(threads)
    cfg = load_config(model)
    total = num_hidden_layers(cfg)
    if not 0 <= start < end <= total:
        raise ValueError(f"span [{start}, {end}) outside the model's {total} layers")
    n = end - start
    from ..models.presets import set_num_hidden_layers

    set_num_hidden_layers(cfg, n)
    vocab = int(cfg.vocab_size)
    if not has_embed and not has_tail:
        cfg.vocab_size = 8  # neither vocabulary matrix lives on such a stage
    if has_embed != has_tail:
        cfg.tie_word_embeddings = True  # the stage holds exactly one vocabulary matrix
    torch.manual_seed(0)
    with PeakRSS() as rss:
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        hidden = int(getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd"))
        if has_embed:
            kw = {"input_ids": torch.randint(0, vocab, (batch, seq_len))}
        else:
            kw = {"inputs_embeds": torch.randn(batch, seq_len, hidden)}
        if has_tail:
            ids = kw.get("input_ids")
            labels = ids if ids is not None else torch.randint(0, vocab, (batch, seq_len))
            loss = m(**kw, labels=labels).loss
            loss.backward()
        else:
            out = m.base_model(**kw).last_hidden_state
            out.backward(torch.randn_like(out))
        opt.step()
        opt.zero_grad(set_to_none=False)
    return {"start": start, "end": end, "has_embed": has_embed, "has_tail": has_tail, "batch": batch,
            "peak_bytes": int(rss.peak - rss.base), "base_rss_bytes": int(rss.base)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--embed", action="store_true")
    p.add_argument("--tail", action="store_true")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    print(json.dumps(run_span(a.model, a.start, a.end, a.embed, a.tail, a.batch, a.seq_len, a.threads)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

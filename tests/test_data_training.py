"""Training on prepared and raw data: a 2-stage pipeline trains to the losses of plain HF on
the same token file (fp32, relative 1e-6) for raw forms prepared through the cache, a DatasetDict split
and a prepared corpus with held-out documents; the wrong tokens are refused on every rank
before any collective (exit 2), and the tokenizer goes into the export."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_harness import RankPool
from tiny_hf import ROOT, TEXT, tiny_llama
from torchpp.data import TokenCorpus, held_out, prepare_corpus
from torchpp.models.presets import load_config, model_info
from torchpp.planner.simple import make_plan

SEQ, BATCH, STEPS, LR = 16, 4, 3, 3e-3


def _forms(d: Path) -> Path:
    """One folder of every raw form: text, markdown, JSON lines (with a metadata .json beside),
    parquet and a nested save_to_disk Dataset."""
    import datasets

    d.mkdir()
    lines = TEXT.read_text().splitlines()
    (d / "a.txt").write_text("\n".join(lines[:40]))
    (d / "b.md").write_text("\n".join(lines[40:80]))
    (d / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[80:140] if t.strip()))
    (d / "dataset_info.json").write_text(json.dumps({"description": "metadata"}))
    datasets.Dataset.from_dict({"text": lines[140:200]}).to_parquet(str(d / "e.parquet"))
    datasets.Dataset.from_dict({"text": lines[200:260], "n": list(range(60))}).save_to_disk(str(d / "saved"))
    return d


def _result(rank: int, world: int, case: dict) -> None:
    from torchpp.runtime.trainer import TrainConfig, train

    s = train(TrainConfig(**case["config"]))
    if rank == 0:
        Path(case["result"]).write_text(json.dumps({"losses": s.losses, "eval": s.eval_losses}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("datatrain")
    model = tiny_llama(root / "model", vocab_size=400)
    info = model_info(load_config(str(model)), str(model))
    make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(root / "plan.json")
    forms = _forms(root / "forms")
    lines = [t for t in TEXT.read_text().splitlines() if t.strip()]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": lines[:150]}),
                          "test": datasets.Dataset.from_dict({"text": lines[150:160]})}).save_to_disk(str(root / "dd"))
    prepare_corpus([forms], root / "corpus", tokenizer=model, num_proc=2)
    common = dict(plan=root / "plan.json", model=str(model), steps=STEPS, lr=LR, seed=5, threads=1, timeout_s=60.0,
                  data_cache=root / "cache")
    cases = {"raw": dict(data=str(forms), export_dir=root / "export"),
             "split": dict(data=str(root / "dd"), split="train"),
             "corpus_eval": dict(data=str(root / "corpus"), eval_fraction=0.3, eval_batches=2)}
    with RankPool(2, threads=1) as pool:
        for name, kw in cases.items():
            pool.run(_result, {"result": str(root / f"{name}.json"), "config": {**common, **kw}}, world=2,
                     timeout_s=300, pg_timeout_s=60)
    return root


def _reference(model_dir: Path, source, eval_source=None):
    """Plain HF: the model from its directory, AdamW, batches read from the token file with numpy."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="sdpa")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    flat = np.fromfile(source.root / "tokens.bin", dtype="<u2").astype(np.int64)
    rows = lambda ids: torch.from_numpy(np.stack([flat[i * SEQ:(i + 1) * SEQ] for i in ids]))  # noqa: E731
    losses = []
    for step in range(STEPS):
        ids = rows(source.block_ids(step))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    evals = None
    if eval_source is not None:
        model.eval()
        with torch.no_grad():
            evals = sum(model(input_ids=eval_source.batch(i), labels=eval_source.batch(i)).loss.item()
                        for i in range(2)) / 2
    return losses, evals


def _cached(root: Path) -> list[Path]:
    return sorted(p for p in (root / "cache").iterdir() if (p / "index.json").is_file())


def test_raw_forms_train_as_plain_hf_on_the_same_token_file(runs):
    raw = [c for c in _cached(runs) if json.loads((c / "index.json").read_text())["split"] is None]
    assert len(raw) == 1
    index = json.loads((raw[0] / "index.json").read_text())
    assert {Path(s["path"]).name for s in index["sources"]} == {"a.txt", "b.md", "c.jsonl", "e.parquet", "saved"}
    losses, _ = _reference(runs / "model", TokenCorpus(raw[0], seq_len=SEQ, global_batch=BATCH, seed=5))
    got = json.loads((runs / "raw.json").read_text())["losses"]
    assert got == pytest.approx(losses, rel=1e-6) and got[-1] < got[0]


def test_a_dataset_dict_split_trains_as_plain_hf(runs):
    dd = [c for c in _cached(runs) if json.loads((c / "index.json").read_text())["split"] == "train"]
    assert len(dd) == 1
    losses, _ = _reference(runs / "model", TokenCorpus(dd[0], seq_len=SEQ, global_batch=BATCH, seed=5))
    assert json.loads((runs / "split.json").read_text())["losses"] == pytest.approx(losses, rel=1e-6)


def test_a_prepared_corpus_with_held_out_documents_trains_and_evaluates_as_plain_hf(runs):
    train, ev = held_out(TokenCorpus(runs / "corpus", seq_len=SEQ, global_batch=BATCH, seed=5), 0.3)
    losses, evals = _reference(runs / "model", train, ev)
    got = json.loads((runs / "corpus_eval.json").read_text())
    assert got["losses"] == pytest.approx(losses, rel=1e-6)
    assert got["eval"][-1][1] == pytest.approx(evals, abs=1e-5)  # after 3 steps' fp32 drift


def test_the_export_carries_the_tokenizer(runs):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(runs / "export"))
    ref = AutoTokenizer.from_pretrained(str(runs / "model"))
    assert tok("pipeline stages")["input_ids"] == ref("pipeline stages")["input_ids"]


def _prepare_error(tmp_path, **kw) -> str:
    from torchpp.data import DataError
    from torchpp.runtime.trainer import TrainConfig, prepare

    with pytest.raises(DataError) as e:
        prepare(TrainConfig(plan=tmp_path / "plan.json", data_cache=tmp_path / "cache", **kw), 2)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_wrong_tokens_are_refused_naming_the_fix(tmp_path):
    bare = tiny_llama(tmp_path / "bare", vocab_size=400, tokenizer=False)
    small = tiny_llama(tmp_path / "small", vocab_size=300, tokenizer=False)
    tok = tiny_llama(tmp_path / "withtok", vocab_size=400)
    other = tmp_path / "other_tok"
    from tiny_hf import train_tokenizer

    train_tokenizer(other, files=[ROOT / "README.md"], vocab_size=380)
    info = model_info(load_config(str(bare)), str(bare))
    make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(tmp_path / "plan.json")
    (tmp_path / "t.txt").write_text(TEXT.read_text()[:3000])
    msg = _prepare_error(tmp_path, model=str(bare), data=str(tmp_path / "t.txt"))
    assert "has no tokenizer" in msg and "--tokenizer DIR" in msg
    small_plan = make_plan(model_info(load_config(str(small)), str(small)), seq_len=SEQ, global_batch=BATCH,
                           num_microbatches=2, layer_ranges=[(0, 2), (2, 4)], group_sizes=[1, 1], schedule="1f1b")
    small_plan.save(tmp_path / "plan.json")
    msg = _prepare_error(tmp_path, model=str(small), data=str(tmp_path / "t.txt"), tokenizer=str(tok))
    assert "more than the vocab_size 300" in msg
    make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(tmp_path / "plan.json")
    prepare_corpus([tmp_path / "t.txt"], tmp_path / "corpus", tokenizer=other, num_proc=1)
    msg = _prepare_error(tmp_path, model=str(tok), data=str(tmp_path / "corpus"))
    assert "tokenized with 'other_tok'" in msg and "prepare the corpus again" in msg


def test_text_without_a_tokenizer_is_exit_2_on_every_rank(tmp_path):
    bare = tiny_llama(tmp_path / "bare", vocab_size=400, tokenizer=False)
    info = model_info(load_config(str(bare)), str(bare))
    make_plan(info, seq_len=SEQ, global_batch=BATCH, num_microbatches=2, layer_ranges=[(0, 2), (2, 4)],
              group_sizes=[1, 1], schedule="1f1b").save(tmp_path / "plan.json")
    (tmp_path / "t.txt").write_text("some text " * 100)
    cmd = [sys.executable, "-m", "torchpp.train", "--plan", str(tmp_path / "plan.json"), "--model", str(bare),
           "--data", str(tmp_path / "t.txt"), "--steps", "1", "--threads", "1", "--timeout-s", "30"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "RANK": str(r),
                                   "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "1"})  # no rank may reach a collective: the port is never used
             for r in range(2)]
    for r, p in enumerate(procs):
        _, err = p.communicate(timeout=300)
        lines = [ln for ln in err.splitlines() if ln.strip() and "warn" not in ln.lower()]
        assert p.returncode == 2 and len(lines) == 1, err[-2000:]
        assert lines[0].startswith(f"torchpp.train: rank {r}: error: --data: ") and "has no tokenizer" in lines[0]

"""Data: every input form tokenizes to the tokenizer's own ids (EOS between documents) in one
memory-mapped file; every bad input is one line (exit 2); the order is a function of (seed,
step); held-out documents are whole and leave the training order of the rest as it was."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny_hf import train_tokenizer
from torchpp.cli import main as cli
from torchpp.data import DataError, TokenCorpus, discover, held_out, load_index, prepare_corpus

DOCS = [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + 3 * i)) for i in range(12)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    from transformers import AutoTokenizer

    return d, AutoTokenizer.from_pretrained(str(d))


def _expected(hf, docs):
    return [t for d in docs for t in hf(d, add_special_tokens=False)["input_ids"] + [hf.eos_token_id]]


def _write_form(form: str, d, docs):
    """``docs`` in ``form`` under ``d``; returns the --data path (and the split, for a DatasetDict)."""
    import datasets

    d.mkdir(parents=True, exist_ok=True)
    rows = [{"id": i, "text": t} for i, t in enumerate(docs)]
    if form == "txt":
        for i, t in enumerate(docs):
            (d / f"doc{i:02d}{'.md' if i % 2 else '.txt'}").write_text(t)
        return d, None
    if form == "jsonl":
        (d / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "dataset_info.json").write_text(json.dumps({"description": "metadata", "splits": {}}))
        return d, None
    if form == "json":
        (d / "a.json").write_text(json.dumps(rows))
        return d / "a.json", None
    ds = datasets.Dataset.from_list(rows)
    if form == "csv":
        ds.to_csv(str(d / "a.csv"), index=False)
        return d / "a.csv", None
    if form == "parquet":
        ds.to_parquet(str(d / "a.parquet"))
        return d / "a.parquet", None
    if form == "arrow":
        ds.save_to_disk(str(d / "saved"))
        return next((d / "saved").glob("*.arrow")), None
    if form == "dataset":
        ds.save_to_disk(str(d / "saved"))
        return d / "saved", None
    if form == "dataset_dict":
        datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(str(d / "dd"))
        return d / "dd", "train"
    raise AssertionError(form)


FORMS = ["txt", "jsonl", "json", "csv", "parquet", "arrow", "dataset", "dataset_dict"]


@pytest.mark.parametrize("form", FORMS)
def test_every_form_gives_the_tokenizers_ids(tmp_path, tok, form):
    tdir, hf = tok
    path, split = _write_form(form, tmp_path / "in", DOCS)
    index = prepare_corpus([path], tmp_path / "corpus", tokenizer=tdir, split=split, num_proc=2 if form == "txt" else 1)
    want = _expected(hf, DOCS)
    got = np.fromfile(tmp_path / "corpus" / "tokens.bin", dtype="<u2")
    assert got.tolist() == want and index.dtype == "uint16"
    offs = np.fromfile(tmp_path / "corpus" / "offsets.bin", dtype="<i8")
    assert len(offs) == len(DOCS) + 1 and (got[offs[1:] - 1] == hf.eos_token_id).all()
    assert index.documents == len(DOCS) and load_index(tmp_path / "corpus").key == index.key


def test_long_text_is_cut_into_pieces_without_changing_the_document(tmp_path, tok, monkeypatch):
    import torchpp.data.sources as S

    tdir, hf = tok
    text = "".join(f"line {i} of a long file\n" for i in range(400))
    (tmp_path / "big.txt").write_text(text)
    monkeypatch.setattr(S, "PIECE_BYTES", 1000)
    src = discover([tmp_path / "big.txt"]).sources[0]
    assert len(src.pieces) > 5
    index = prepare_corpus([tmp_path / "big.txt"], tmp_path / "c", tokenizer=tdir,
                           inputs=discover([tmp_path / "big.txt"]))
    assert index.documents == 1
    assert np.fromfile(tmp_path / "c" / "tokens.bin", dtype="<u2").tolist() == _expected(hf, [text])


def _cli_error(capsys, *args):
    rc = cli(["data", "prepare", *map(str, args)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("torchpp data prepare: error: "), err
    return err


@pytest.mark.parametrize("name,content,reason", [
    ("blob.bin", bytes(range(256)), "expected .txt"),
    ("bad.txt", bytes(range(128, 256)) * 4, "not UTF-8 text"),
    ("zeros.txt", b"abc\x00\x00def" * 10, "binary file"),
    ("broken.parquet", b"PAR1 this is not parquet", "cannot be read as a parquet table"),
    ("broken.arrow", b"not arrow", "cannot be read as an arrow stream"),
    ("nocol.csv", b"id,body\n1,hello\n", "text column 'text' not found.*--text-column"),
    ("nocol.jsonl", b'{"body": "x"}\n', "text column 'text' not found"),
    ("meta.json", b'{"name": "x"}', "text column 'text' not found"),
])
def test_bad_inputs_are_one_line_exit_2(tmp_path, tok, capsys, name, content, reason):
    (tmp_path / name).write_bytes(content)
    err = _cli_error(capsys, "--data", tmp_path / name, "--tokenizer", tok[0], "--out", tmp_path / "c")
    assert name in err
    import re

    assert re.search(reason, err), err


def test_bad_folders_and_tokenizers_are_one_line_exit_2(tmp_path, tok, capsys):
    path, _ = _write_form("dataset_dict", tmp_path / "in", DOCS)
    assert "--split" in _cli_error(capsys, "--data", path, "--tokenizer", tok[0], "--out", tmp_path / "c")
    assert "split 'dev' not found" in _cli_error(capsys, "--data", path, "--split", "dev", "--tokenizer", tok[0],
                                                 "--out", tmp_path / "c")
    assert "no such file" in _cli_error(capsys, "--data", tmp_path / "nope", "--tokenizer", tok[0])
    (tmp_path / "t.txt").write_text("text")
    assert "HF tokenizer directory" in _cli_error(capsys, "--data", tmp_path / "t.txt", "--tokenizer", tmp_path / "in",
                                                  "--out", tmp_path / "c")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "precious.txt").write_text("keep")
    assert "other files" in _cli_error(capsys, "--data", tmp_path / "t.txt", "--tokenizer", tok[0], "--out",
                                       tmp_path / "full")
    (tmp_path / "only_meta").mkdir()
    (tmp_path / "only_meta" / "info.json").write_text("{}")
    assert "found none" in _cli_error(capsys, "--data", tmp_path / "only_meta", "--tokenizer", tok[0])


def _corpus(tmp_path, n_docs=40, seq=8, batch=4, seed=3):
    docs = [f"{i:04d}" * (3 + i % 5) for i in range(n_docs)]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    prepare_corpus([tmp_path / "in"], tmp_path / "c", tokenizer="bytes", num_proc=1)
    return TokenCorpus(tmp_path / "c", seq_len=seq, global_batch=batch, seed=seed)


def test_order_is_a_function_of_seed_and_step_and_visits_each_block_once_per_epoch(tmp_path):
    c = _corpus(tmp_path)
    again = TokenCorpus(tmp_path / "c", seq_len=8, global_batch=4, seed=3)
    n = len(c)
    flat = np.fromfile(tmp_path / "c" / "tokens.bin", dtype="<u2").astype(np.int64)
    for step in (0, 1, n // 4 + 3):
        assert torch.equal(c.batch(step), again.batch(step))
        ids = c.block_ids(step)
        assert torch.equal(c.batch(step), torch.from_numpy(np.stack([flat[i * 8:(i + 1) * 8] for i in ids])))
    epoch = np.concatenate([c.block_ids(s) for s in range(n // 4)])
    assert len(set(epoch.tolist())) == len(epoch) and epoch.max() < n
    assert not np.array_equal(epoch, np.sort(epoch))  # shuffled
    other = TokenCorpus(tmp_path / "c", seq_len=8, global_batch=4, seed=4)
    assert not np.array_equal(epoch, np.concatenate([other.block_ids(s) for s in range(n // 4)]))


def test_held_out_documents_are_whole_and_the_training_order_of_the_rest_is_unchanged(tmp_path):
    c = _corpus(tmp_path, n_docs=60)
    train, ev = held_out(c, 0.2)
    offs = np.fromfile(tmp_path / "c" / "offsets.bin", dtype="<i8")
    held = [(int(a), int(b)) for a, b in ev.spans]
    assert 0 < len(held) < 60 and all((a, b) in set(zip(offs[:-1].tolist(), offs[1:].tolist())) for a, b in held)
    assert held != list(zip(offs[:-1].tolist(), offs[1:].tolist()))[-len(held):]  # a seeded draw, not the last ones
    flat = np.fromfile(tmp_path / "c" / "tokens.bin", dtype="<u2").astype(np.int64)
    held_tokens = np.concatenate([flat[a:b] for a, b in held])
    assert torch.equal(ev.batch(0), torch.from_numpy(held_tokens[:32].reshape(4, 8)))
    # training: the full order with the blocks touching a held-out document skipped
    steps = len(train) // 4
    full = np.concatenate([c.block_ids(s) for s in range(len(c) // 4 + 1)])[:len(c)]
    kept = [b for b in full if b in set(train.keep.tolist())]
    assert np.concatenate([train.block_ids(s) for s in range(steps)]).tolist() == kept[:steps * 4]
    for b in train.keep:  # no training block holds a held-out token
        assert all(not (a < (b + 1) * 8 and b * 8 < e) for a, e in held)
    with pytest.raises(DataError, match="--eval-fraction"):
        held_out(c, 1.5)

"""Data files: tables are read by their text column, binary files are refused with one line."""
from __future__ import annotations

import pytest
import torch

from torchpp.data import DataError, PackedText, open_source


def _open(path, **kw):
    return open_source(str(path), seq_len=8, global_batch=2, vocab_size=512, seed=0, **kw)


def test_csv_reads_only_the_text_column(tmp_path):
    rows = [f"row number {i} of the corpus" for i in range(20)]
    (tmp_path / "d.csv").write_text("id,body,label\n" + "".join(f"{i},{r},x{i}\n" for i, r in enumerate(rows)))
    src = _open(tmp_path / "d.csv", text_column="body")
    assert len(src) == len("".join(rows).encode()) // 8  # the body cells only: no header, ids or labels
    got = bytes(src.blocks.flatten().tolist())
    assert b"body" not in got and b"label" not in got and b"row number 3 of" in got
    with pytest.raises(DataError, match="text column 'text' not found.*--text-column"):
        _open(tmp_path / "d.csv")


def test_parquet_is_a_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"parquet text {i}" for i in range(30)], "n": list(range(30))}),
                   tmp_path / "d.parquet")
    src = _open(tmp_path / "d.parquet")
    assert b"parquet text 7" in bytes(src.blocks.flatten().tolist())
    # a directory mixing tables and text is read in name order, the same for every rank
    (tmp_path / "e.txt").write_text("plain text file " * 4)
    a, b = _open(tmp_path), _open(tmp_path)
    assert torch.equal(a.batch(1), b.batch(1)) and len(a) > len(src)


@pytest.mark.parametrize("name,content,reason", [
    ("blob.bin", bytes(range(256)) * 4, "not UTF-8 text"),
    ("zeros.txt", b"abc\x00\x00def" * 10, "binary file"),
    ("broken.parquet", b"PAR1 this is not parquet", "cannot be read as a parquet table"),
])
def test_binary_or_undecodable_files_are_refused_with_one_line(tmp_path, name, content, reason):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError, match=reason) as e:
        PackedText([tmp_path / name], seq_len=8, global_batch=2, vocab_size=512)
    assert name in str(e.value) and "\n" not in str(e.value)

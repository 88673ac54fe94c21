"""`torchpp bandwidth parse`: an iperf3-style CSV to bandwidth.json (seed 000 step 3).

Rows are ``src_host,dst_host,gbps`` (no header; an optional fourth column is the latency in
milliseconds; ``#`` starts a comment). Repeated measurements of one link are averaged. Every
ordered pair of the hosts named must be present, or the error names the missing ones; with
``assume_symmetric`` a missing direction takes the other direction's rate.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

from ..formats import Bandwidth, FormatError
from .. import validate as V


MAX_CSV_BYTES = 8 << 20
"""A links CSV's size (about 250,000 rows: every ordered pair of 500 hosts, measured once)."""


def _rows(path: str | Path) -> list[list[str]]:
    """The CSV's rows; a folder or a file that is not UTF-8 text is named in the error."""
    if Path(path).is_dir():
        raise FormatError(str(path), "<file>", "a CSV file, not a directory")
    V.input_file(path, "--csv", MAX_CSV_BYTES)  # a device, a FIFO or a huge file: refused before reading
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.reader(f))
    except UnicodeDecodeError as e:
        raise FormatError(str(path), "<file>", f"UTF-8 text ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise FormatError(str(path), "<file>", f"CSV rows ({e})") from None


def parse_links_csv(path: str | Path, assume_symmetric: bool = False) -> Bandwidth:
    src = str(path)
    rates: dict[str, list[float]] = {}
    lats: dict[str, list[float]] = {}
    for lineno, row in enumerate(_rows(path), 1):
        row = [c.strip() for c in row]
        if not row or not any(row) or row[0].startswith("#"):
            continue
        if len(row) not in (3, 4):
            raise FormatError(src, f"line {lineno}", "src_host,dst_host,gbps[,latency_ms]", ",".join(row))
        a, b = row[0], row[1]
        if not a or not b or a == b:
            raise FormatError(src, f"line {lineno}", "two different host names", ",".join(row[:2]))
        try:
            gbps = float(row[2])
            lat = float(row[3]) if len(row) == 4 else None
        except ValueError:
            if lineno == 1:
                raise FormatError(src, "line 1", "no header: src_host,dst_host,gbps rows", ",".join(row)) from None
            raise FormatError(src, f"line {lineno}.gbps", "a number", ",".join(row)) from None
        if not math.isfinite(gbps) or gbps <= 0 or gbps * 1e9 / 8 > V.MAX_RATE:
            raise FormatError(src, f"line {lineno}.gbps", f"a rate > 0 and at most {V.MAX_RATE * 8 / 1e9:g}", row[2])
        if lat is not None and (not math.isfinite(lat) or lat < 0):
            raise FormatError(src, f"line {lineno}.latency_ms", "a latency >= 0", row[3])
        k = Bandwidth.key(a, b)
        rates.setdefault(k, []).append(gbps * 1e9 / 8)
        if lat is not None:
            lats.setdefault(k, []).append(lat / 1e3)
    if not rates:
        raise FormatError(src, "<file>", "at least one src_host,dst_host,gbps row")
    bw = Bandwidth(bytes_per_sec={k: sum(v) / len(v) for k, v in rates.items()},
                   latency_s={k: sum(v) / len(v) for k, v in lats.items()}, source=f"iperf3 csv {Path(path).name}")
    if assume_symmetric:
        for k in list(bw.bytes_per_sec):
            a, b = k.split("|")
            rk = Bandwidth.key(b, a)
            bw.bytes_per_sec.setdefault(rk, bw.bytes_per_sec[k])
            if k in bw.latency_s:
                bw.latency_s.setdefault(rk, bw.latency_s[k])
    missing = bw.missing_links(bw.hosts())
    if missing:
        raise FormatError(src, "<rows>", "a row for every ordered host pair (or --assume-symmetric); missing "
                          + ", ".join(m.replace("|", "->") for m in missing))
    return bw

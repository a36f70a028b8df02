# Writes the corpus and queries of the `rlx search` benchmark
# (scripts/bench-search): reproducible lines of mixed length made from the
# sentences of bench/embed-corpus.txt, cut and recombined so that every line
# is different (identical lines would be embedded once).
#
#   python3 bench/search-corpus.py DIR LINES QUERIES [--random-npy]
#
# DIR/corpus.txt (LINES lines), DIR/queries.txt (QUERIES lines) and, with
# --random-npy, DIR/random.npy: LINES random unit rows of dimension 384
# (float32), to time the search alone without embedding the corpus first.
import os
import random
import struct
import sys

here = os.path.dirname(os.path.abspath(__file__))
out, lines, queries = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random_npy = "--random-npy" in sys.argv[4:]
os.makedirs(out, exist_ok=True)
with open(os.path.join(here, "embed-corpus.txt"), encoding="utf-8") as f:
    words = [s.split() for s in f.read().splitlines() if s.strip()]
rng = random.Random(20261202)


def line():
    a, b = rng.choice(words), rng.choice(words)
    n = rng.randint(4, 40) if rng.random() < 0.9 else rng.randint(40, 120)
    i, j = rng.randrange(len(a)), rng.randrange(len(b))
    return " ".join((a[i:] + b[:j] + a)[:n]).capitalize() + rng.choice([".", ".", "?", "!"])


seen = set()
with open(os.path.join(out, "corpus.txt"), "w", encoding="utf-8") as f:
    n = 0
    while n < lines:
        s = line()
        if s not in seen:
            seen.add(s)
            f.write(s + "\n")
            n += 1
with open(os.path.join(out, "queries.txt"), "w", encoding="utf-8") as f:
    for _ in range(queries):
        f.write(" ".join(line().split()[:12]) + "\n")
if random_npy:
    dim = 384
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d, %d), }" % (lines, dim)
    header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
    with open(os.path.join(out, "random.npy"), "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
        for _ in range(lines):
            v = [rng.gauss(0.0, 1.0) for _ in range(dim)]
            norm = sum(x * x for x in v) ** 0.5
            f.write(struct.pack("<%df" % dim, *(x / norm for x in v)))

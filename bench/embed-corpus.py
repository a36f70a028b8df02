# Writes bench/embed-corpus.txt: 1,000 reproducible sentences of mixed length
# (fixed seed and word list) for the end-to-end embedding benchmark. Run from bench/.
import random
WORDS = """the of and to in is was for on that with as by at from his her it an are were be this which or
have has had not but they their one all new more when there been who will would so its also can into
than after first two other time year years most only over some people could many these such between
through city world during state made under used known like later where while century government
system music school became new film water river team season company university history national
series family number part three including called life found public war second several early group
area based long since game work album because small high same place however best own around members
data model network language vector engine compiler memory kernel thread batch token layer attention
quick brown fox jumps lazy dog cat sat mat kitten rests rug market prices fell sharply rose morning
coffee pizza rain garden mountain ocean bridge library window summer winter light dark story
""".split()
PUNCT = [",", ",", ";", " -", ":"]
rng = random.Random(20261130)
lines = []
for i in range(1000):
    r = rng.random()
    n = rng.randint(3, 25) if r < 0.7 else rng.randint(25, 80) if r < 0.95 else rng.randint(80, 180)
    words = [rng.choice(WORDS) for _ in range(n)]
    for j in range(3, n - 1, rng.randint(6, 14)):
        words[j] += rng.choice(PUNCT)
    if rng.random() < 0.15:
        words.insert(rng.randint(0, n), str(rng.randint(1, 9999)))
    s = " ".join(words)
    lines.append(s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!"]))
with open("embed-corpus.txt", "w") as f:
    f.write("\n".join(lines) + "\n")

"""The rlx Python package against the Rust APIs and sentence-transformers.

Run by crates/rlx-python/tests/python.rs, which builds the wheel into a venv
and sets:
  RLX_TEST_REFERENCE     JSON of Rust outputs: texts, their SentenceEmbedder
                         vectors as f32 bit patterns, greedy Generator texts
  RLX_TEST_MINILM        the all-MiniLM-L6-v2 directory
  RLX_TEST_GGUF          the SmolLM2-135M-Instruct GGUF file
  RLX_TEST_ST_REFERENCE  recorded sentence-transformers outputs
                         (crates/rlx-models/tests/data/minilm/embeddings.json)
A missing variable fails the test that needs it.
"""

import json
import os
import threading
import time

import numpy as np
import pytest

import rlx


def env(name):
    value = os.environ.get(name)
    assert value, f"{name} is not set: run these tests through `cargo test -p rlx-python --test python`"
    return value


@pytest.fixture(scope="module")
def reference():
    with open(env("RLX_TEST_REFERENCE")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def st_reference():
    with open(env("RLX_TEST_ST_REFERENCE")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def embedder():
    return rlx.SentenceEmbedder(env("RLX_TEST_MINILM"))


@pytest.fixture(scope="module")
def generator():
    return rlx.Generator(env("RLX_TEST_GGUF"), ctx_size=512)


def test_encode_equals_the_rust_embedder_bit_for_bit(embedder, reference):
    texts = reference["texts"]
    got = embedder.encode(texts)
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == (len(texts), 384)
    want = np.array(reference["embedding_bits"], dtype=np.uint32).view(np.float32)
    assert want.shape == got.shape
    differ = np.nonzero(np.any(got.view(np.uint32) != want.view(np.uint32), axis=1))[0]
    assert differ.size == 0, f"rows differing from Rust: {differ.tolist()}"


def test_encode_matches_sentence_transformers(embedder, st_reference):
    items = st_reference["items"]
    texts = [it["text"] for it in items]
    got = embedder.encode(texts)
    assert got.shape == (len(items), 384) and got.dtype == np.float32
    want = np.array([it["embedding"] for it in items], dtype=np.float32)
    diff = np.abs(got - want).max(axis=1)
    assert diff.max() <= 1e-5, f"max abs diff per text: {diff.tolist()}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # The recorded padded batch (mixed lengths in one forward pass).
    batch = st_reference["batch"]
    got = embedder.encode([texts[i] for i in batch["text_indices"]])
    assert np.abs(got - np.array(batch["embeddings"], dtype=np.float32)).max() <= 1e-5


def test_one_string_gives_one_vector(embedder, st_reference):
    item = st_reference["items"][0]
    v = embedder.encode(item["text"])
    assert v.shape == (384,) and v.dtype == np.float32
    assert np.abs(v - np.array(item["embedding"], dtype=np.float32)).max() <= 1e-5
    empty = embedder.encode("")
    assert empty.shape == (384,)
    assert embedder.encode([]).shape == (0, 384)


def test_encode_options(embedder, reference):
    texts = reference["texts"][:20]
    base = embedder.encode(texts)
    rows = embedder.encode(texts, convert_to_numpy=False)
    assert isinstance(rows, list) and len(rows) == len(texts)
    assert all(r.shape == (384,) and r.dtype == np.float32 for r in rows)
    assert np.array_equal(np.stack(rows), base)
    # Another forward batch size: the same vectors up to kernel rounding.
    small = embedder.encode(texts, batch_size=3)
    assert small.shape == base.shape
    assert np.abs(small - base).max() <= 1e-5
    # MiniLM normalises already; normalising again changes nothing but rounding.
    normed = embedder.encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(np.linalg.norm(normed, axis=1), 1.0, atol=1e-6)
    assert np.abs(normed - base).max() <= 1e-6


def test_properties(embedder):
    assert embedder.dimension == 384
    assert embedder.get_sentence_embedding_dimension() == 384
    assert embedder.max_seq_length == 256
    assert embedder.device == "cpu"
    assert embedder.model == env("RLX_TEST_MINILM")
    assert "SentenceEmbedder(" in repr(embedder)
    assert embedder.tokenize([""]) == [[101, 102]]


def test_embedder_errors_raise_with_the_rust_message(embedder, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        rlx.SentenceEmbedder(str(missing))
    a_file = tmp_path / "config.json"
    a_file.write_text("{}")
    with pytest.raises(RuntimeError, match="is a file, not a model directory"):
        rlx.SentenceEmbedder(str(a_file))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(RuntimeError, match="config.json"):
        rlx.SentenceEmbedder(str(broken))
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:N'"):
        rlx.SentenceEmbedder(env("RLX_TEST_MINILM"), device="tpu")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        rlx.SentenceEmbedder(env("RLX_TEST_MINILM"), dtype="int8")
    with pytest.raises(ValueError, match="expected a str or a list of str, found int"):
        embedder.encode(42)
    with pytest.raises(ValueError, match="expected a str or a list of str"):
        embedder.encode(["fine", 7])
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        embedder.encode(["x"], batch_size=0)


def test_default_model_is_found_as_the_cli_finds_it(monkeypatch):
    monkeypatch.setenv("RLX_MODEL_DIR", env("RLX_TEST_MINILM"))
    assert rlx.SentenceEmbedder().model == env("RLX_TEST_MINILM")
    monkeypatch.setenv("RLX_MODEL_DIR", "/nonexistent/rlx-model")
    with pytest.raises(FileNotFoundError, match="RLX_MODEL_DIR"):
        rlx.SentenceEmbedder()


def test_encode_releases_the_gil(embedder):
    # Distinct texts (identical ones are embedded once), enough for seconds.
    texts = [f"sentence {i}: the quick brown fox number {i * 7919 % 1000} jumps over lazy dog {i}" for i in range(1500)]
    done = {}

    def work():
        t0 = time.perf_counter()
        done["vectors"] = embedder.encode(texts)
        done["span"] = (t0, time.perf_counter())

    worker = threading.Thread(target=work)
    worker.start()
    ticks = []
    while worker.is_alive():
        ticks.append(time.perf_counter())
        sum(range(200))
    worker.join()
    start, end = done["span"]
    inside = [t for t in ticks if start <= t <= end]
    assert done["vectors"].shape == (1500, 384)
    assert end - start > 0.3, f"encode took only {end - start:.3f} s: too short to tell"
    # Held GIL: this thread would stand still from encode's start to its end.
    points = [start] + inside + [end]
    longest_gap = max(b - a for a, b in zip(points, points[1:]))
    assert longest_gap < (end - start) / 2, f"the main thread stalled {longest_gap:.3f} s of {end - start:.3f} s"
    assert len(inside) > 100, f"only {len(inside)} ticks while encode ran"


def test_greedy_generation_equals_the_rust_generator(generator, reference):
    g = reference["generate"]
    assert generator.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0) == g["text"]
    c = reference["chat"]
    messages = [{"role": "user", "content": c["user"]}]
    assert generator.chat(messages, max_tokens=c["max_tokens"], temperature=0) == c["text"]
    pieces = list(generator.chat(messages, max_tokens=c["max_tokens"], temperature=0, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == c["text"]
    assert generator.tokenize("Hello") and generator.ctx_size == 512


def test_sampling_is_seeded(generator):
    a = generator.generate("Once upon a time", max_tokens=16, temperature=0.9, seed=7)
    b = generator.generate("Once upon a time", max_tokens=16, temperature=0.9, seed=7)
    assert a == b and a


def test_a_stream_holds_the_model_until_closed(generator, reference):
    g = reference["generate"]
    stream = generator.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0, stream=True)
    first = next(stream)
    assert first
    with pytest.raises(RuntimeError, match="streamed generation is still running"):
        generator.generate("x", max_tokens=2)
    stream.close()
    assert list(stream) == []
    assert generator.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0) == g["text"]


def test_batched_generation_equals_single_runs(reference):
    g = reference["generate"]
    c = reference["chat"]
    batched = rlx.Generator(env("RLX_TEST_GGUF"), ctx_size=256, batch=2)
    prompts = [g["prompt"], "Once upon a time", g["prompt"][: len(g["prompt"]) // 2]]
    want = [batched.generate(p, max_tokens=g["max_tokens"], temperature=0) for p in prompts]
    assert want[0] == g["text"]
    assert batched.generate_batch(prompts, max_tokens=g["max_tokens"], temperature=0) == want
    conversations = [[{"role": "user", "content": c["user"]}], [{"role": "user", "content": "Name a colour."}]]
    replies = batched.chat_batch(conversations, max_tokens=c["max_tokens"], temperature=0)
    assert replies[0] == c["text"] and replies[1] == batched.chat(conversations[1], max_tokens=c["max_tokens"], temperature=0)
    assert batched.generate_batch([]) == []
    with pytest.raises(ValueError, match="prompt 0: sampling: max_tokens must be at least 1"):
        batched.generate_batch(["a", "b"], max_tokens=0)
    with pytest.raises(ValueError, match=r"conversations\[1\]: messages\[0\]: no 'content'"):
        batched.chat_batch([conversations[0], [{"role": "user"}]])
    with pytest.raises(ValueError, match="batch must be at least 1"):
        rlx.Generator(env("RLX_TEST_GGUF"), batch=0)


def test_stop_strings_end_the_text(generator, reference):
    g = reference["generate"]
    full = g["text"]
    word = full.split()[1]
    cut = generator.generate(g["prompt"], max_tokens=g["max_tokens"], temperature=0, stop=[word])
    assert word not in cut and full.startswith(cut)


def test_generator_errors_raise(generator, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        rlx.Generator(str(tmp_path / "missing.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(RuntimeError, match="bad.gguf"):
        rlx.Generator(str(bad))
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        generator.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="top_p must be in 0..=1"):
        generator.generate("x", top_p=2.0)
    with pytest.raises(ValueError, match="empty list"):
        generator.chat([])
    with pytest.raises(ValueError, match=r"messages\[0\]: no 'content'"):
        generator.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="stop: expected"):
        generator.generate("x", stop=5)
    with pytest.raises(ValueError, match="device 'tpu'"):
        rlx.Generator(env("RLX_TEST_GGUF"), device="tpu")


def test_the_default_generator_is_found_in_the_checkout():
    # The suite runs with the repository as the current directory, whose
    # models/ holds the default GGUF.
    g = rlx.Generator(ctx_size=256)
    assert g.model.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_package_metadata():
    assert rlx.__version__
    assert isinstance(rlx.CUDA_BUILT, bool)

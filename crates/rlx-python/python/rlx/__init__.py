"""RLX from Python: sentence embeddings and text generation.

    import rlx
    model = rlx.SentenceEmbedder()              # all-MiniLM-L6-v2, found as `rlx embed` finds it
    vectors = model.encode(["first text", "second text"])   # numpy float32, (2, 384)

    gen = rlx.Generator()                       # SmolLM2-135M-Instruct GGUF, found as `rlx generate` finds it
    print(gen.chat([{"role": "user", "content": "What is 2+2?"}], temperature=0))
"""

from ._rlx import CUDA_BUILT, Generator, SentenceEmbedder, TextStream, __version__

__all__ = ["SentenceEmbedder", "Generator", "TextStream", "CUDA_BUILT", "__version__"]

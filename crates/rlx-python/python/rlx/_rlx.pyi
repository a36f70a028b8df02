from os import PathLike
from typing import Iterator, List, Literal, Mapping, Optional, Sequence, Union, overload

import numpy as np
import numpy.typing as npt

__version__: str
CUDA_BUILT: bool

class SentenceEmbedder:
    def __init__(
        self,
        model: Optional[Union[str, PathLike[str]]] = None,
        device: str = "cpu",
        dtype: Literal["f32", "f16", "bf16"] = "f32",
    ) -> None: ...
    @overload
    def encode(
        self,
        sentences: str,
        batch_size: int = 32,
        normalize_embeddings: bool = False,
        convert_to_numpy: bool = True,
    ) -> npt.NDArray[np.float32]: ...
    @overload
    def encode(
        self,
        sentences: Sequence[str],
        batch_size: int = 32,
        normalize_embeddings: bool = False,
        convert_to_numpy: Literal[True] = True,
    ) -> npt.NDArray[np.float32]: ...
    @overload
    def encode(
        self,
        sentences: Sequence[str],
        batch_size: int = 32,
        normalize_embeddings: bool = False,
        convert_to_numpy: Literal[False] = ...,
    ) -> List[npt.NDArray[np.float32]]: ...
    def tokenize(self, sentences: Sequence[str]) -> List[List[int]]: ...
    def get_sentence_embedding_dimension(self) -> int: ...
    @property
    def dimension(self) -> int: ...
    @property
    def max_seq_length(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def model(self) -> str: ...

class TextStream(Iterator[str]):
    def __iter__(self) -> "TextStream": ...
    def __next__(self) -> str: ...
    def close(self) -> None: ...

class Generator:
    def __init__(
        self,
        model: Optional[Union[str, PathLike[str]]] = None,
        device: str = "cpu",
        ctx_size: int = 4096,
        batch: int = 1,
    ) -> None: ...
    @overload
    def generate(
        self,
        prompt: str,
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
        stream: Literal[False] = False,
    ) -> str: ...
    @overload
    def generate(
        self,
        prompt: str,
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
        *,
        stream: Literal[True],
    ) -> TextStream: ...
    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
        stream: Literal[False] = False,
    ) -> str: ...
    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
        *,
        stream: Literal[True],
    ) -> TextStream: ...
    def generate_batch(
        self,
        prompts: Sequence[str],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
    ) -> List[str]: ...
    def chat_batch(
        self,
        conversations: Sequence[Sequence[Mapping[str, str]]],
        max_tokens: int = 256,
        temperature: float = 0.8,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float = 1.0,
        seed: int = 0,
        stop: Optional[Union[str, Sequence[str]]] = None,
        ignore_eos: bool = False,
    ) -> List[str]: ...
    def tokenize(self, text: str) -> List[int]: ...
    @property
    def ctx_size(self) -> int: ...
    @property
    def model(self) -> str: ...

